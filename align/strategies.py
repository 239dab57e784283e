"""Data-parallel strategies: DDP, FSDP2 and DeepSpeed ZeRO 1-3, on GPUs (NCCL) or CPU (gloo, for tests).

Select one in YAML with ``trainer.strategy``::

    trainer:
      strategy:
        class_path: align.strategies.FSDP2Strategy
        init_args: {param_dtype: bfloat16}

- ``ddp``: Lightning's own ``DDPStrategy`` works unchanged on CPU and GPU.
- :class:`FSDP2Strategy`: Lightning's ``ModelParallelStrategy`` with a pure data-parallel mesh; every
  algorithm module applies ``fully_shard`` per decoder layer, then to the policy, in ``configure_model``
  (see :func:`apply_fsdp2`), with a mixed-precision policy and optional CPU offload.
- :class:`DeepSpeedZeROStrategy`: Lightning's ``DeepSpeedStrategy`` for ZeRO stage 1, 2 or 3 (optionally with
  optimizer/parameter offload), which also runs on CPU: the stock strategy refuses anything but CUDA.
"""

from __future__ import annotations

import argparse
from typing import Literal

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy
from torch import nn

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FSDP2Strategy(ModelParallelStrategy):
    def __init__(
        self,
        param_dtype: Literal["float32", "bfloat16", "float16"] | None = None,
        reduce_dtype: Literal["float32", "bfloat16", "float16"] | None = "float32",
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        **kwargs,
    ):
        """
        Args:
            param_dtype: Dtype of gathered parameters for compute (null keeps the stored dtype).
            reduce_dtype: Dtype of gradient reduce-scatter.
            cpu_offload: Keep sharded parameters and optimizer state in CPU memory.
            reshard_after_forward: Free gathered parameters after forward (ZeRO-3-like); false keeps them to the
                backward (ZeRO-2-like, more memory, less communication).
            save_distributed_checkpoint: Save one shard per rank (fast) instead of a gathered full checkpoint.
        """
        kwargs.setdefault("data_parallel_size", "auto")
        kwargs.setdefault("tensor_parallel_size", 1)
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.cpu_offload = cpu_offload
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":  # pure data parallelism: one shard per process
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def fully_shard_kwargs(self) -> dict:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        kwargs = {
            "mesh": self.device_mesh["data_parallel"],
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=_DTYPES.get(self.param_dtype), reduce_dtype=_DTYPES.get(self.reduce_dtype)
            ),
        }
        if self.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        return kwargs


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers model, found by the classes it declares unsplittable."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def apply_fsdp2(module: nn.Module, strategy: FSDP2Strategy | ModelParallelStrategy) -> None:
    """Shard each decoder layer of every transformers model inside ``module``, then ``module`` itself."""
    from torch.distributed.fsdp import fully_shard

    if isinstance(strategy, FSDP2Strategy):
        kwargs = strategy.fully_shard_kwargs()
    else:
        kwargs = {"mesh": strategy.device_mesh["data_parallel"]}
    for layer in decoder_layers(module):
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)


class DeepSpeedZeROStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054) that also runs on CPU with gloo.

    On CUDA it is Lightning's ``DeepSpeedStrategy`` unchanged. On CPU: the environment is set up as for DDP,
    DeepSpeed's distributed backend is initialised directly, and each process passes its local rank as its
    device rank.
    """

    def __init__(self, stage: Literal[1, 2, 3] = 2, offload_optimizer: bool = False, offload_parameters: bool = False,
                 **kwargs):
        """
        Args:
            stage: ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters.
            offload_optimizer: Keep optimizer state in CPU memory (ZeRO-Offload).
            offload_parameters: Keep parameters in CPU memory (stage 3 only).
        """
        super().__init__(stage=stage, offload_optimizer=offload_optimizer, offload_parameters=offload_parameters,
                         **kwargs)

    def _on_cpu(self) -> bool:
        return not isinstance(self.accelerator, CUDAAccelerator)

    def setup_environment(self) -> None:
        if not self._on_cpu():
            return super().setup_environment()
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if not self._on_cpu():
            return super().setup_distributed()
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        if not self._on_cpu():
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

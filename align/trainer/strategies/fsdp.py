"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under Lightning's ``ModelParallelStrategy``: the strategy
with a pure data-parallel mesh, and how every algorithm module shards its policy in ``configure_model``."""

from __future__ import annotations

from typing import Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from align.errors import AlignConfigError

# Keyed by a dtype setting; ``.get(None)`` is None, which keeps the stored dtype.
_DTYPES: dict[str | None, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
FORWARD_METHODS = ("token_logprobs", "next_token_logprobs", "response_logits", "values", "generate")
"""``PolicyModel`` methods other than ``forward`` that run the model (tests/trainer/strategies pins that they exist)."""


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
        for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value is not None and value not in _DTYPES:
                raise AlignConfigError(
                    f"trainer.strategy.{name}: expected float32, bfloat16, float16 or null, got {value!r}"
                )
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
    names: set[str] = set()
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
    root = fully_shard(module, **kwargs)  # ``module`` itself, now an FSDPModule
    # Methods other than ``forward`` that run the model: FSDP gathers the root's own parameters (embeddings,
    # output head, value heads) around them as it does around ``forward``.
    from torch.distributed.fsdp import register_fsdp_forward_method

    for name in FORWARD_METHODS:
        if hasattr(module, name):
            register_fsdp_forward_method(module, name)
    # Fix ``module`` as the root now: FSDP otherwise makes the first unit to run forward the root, and a first
    # forward that enters through an inner layer (a rollout, a reward-model pass) would break later root calls.
    root._get_fsdp_state()._lazy_init()

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

Importing this module registers short names for ``trainer.strategy`` (``--trainer.strategy zero3``):
``fsdp2``, ``fsdp2_offload``, ``zero1``, ``zero2``, ``zero2_offload``, ``zero3``, ``zero3_offload``
(``align.cli`` imports it, so the recipes and the ``align`` command know them).

Generation from sharded weights (:func:`generation_context`): under FSDP2 the policy's parameters are gathered
once for the whole rollout (every decoding step then runs on full weights, with no collective per token);
under ZeRO-3 DeepSpeed gathers each layer on use, so every rank must run the same number of decoding steps and
the sampler's stop decision is made across ranks (:func:`global_all`). See docs/distributed.md.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Callable, Iterator, Literal, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, StrategyRegistry
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
    # Methods other than ``forward`` that run the model: FSDP gathers the root's own parameters (embeddings,
    # output head, value heads) around them as it does around ``forward``.
    from torch.distributed.fsdp import register_fsdp_forward_method

    for name in ("score", "values", "generate"):
        if hasattr(module, name):
            register_fsdp_forward_method(module, name)
    # Fix ``module`` as the root now: FSDP otherwise makes the first unit to run forward the root, and a first
    # forward that enters through an inner layer (a rollout, a reward-model pass) would break later root calls.
    module._get_fsdp_state()._lazy_init()


def unshard_root(module: nn.Module) -> None:
    """Gather the root unit's own parameters of an FSDP2-sharded ``module`` (no-op otherwise).

    For code that calls an inner part of the model directly (``policy.model.get_decoder()(...)``), bypassing
    the root's hooks: the root keeps its parameters gathered from forward to backward anyway (FSDP2 does not
    reshard the root after forward), and the post-backward hook reshards them as usual.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        module.unshard()


@contextmanager
def fsdp2_full_parameters(root: nn.Module, within: nn.Module, reshard_after_forward: bool = True) -> Iterator[None]:
    """Gather every FSDP2 unit of ``within`` (and the root unit ``root``) once, keep them gathered, and reshard
    on exit: the forwards inside run on full weights with no collective, whatever their number per rank.

    Args:
        root: The FSDP root module (it holds the parameters outside the decoder layers).
        within: The part to gather (the policy's language model; the reference and critic are left sharded).
        reshard_after_forward: The layers' setting to restore on exit.
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in within.modules() if isinstance(m, FSDPModule) and m is not root]
    try:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
        for unit in [root, *units]:
            if isinstance(unit, FSDPModule):
                unit.unshard()
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(reshard_after_forward, recurse=False)
            unit.reshard()
        if isinstance(root, FSDPModule):
            root.reshard()


def global_all(flag: bool, device: torch.device | str = "cpu") -> bool:
    """``flag`` and-ed over every rank (one all-reduce; the flag itself on a single process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item() > 0.5)


def accumulation_boundary(module, is_boundary: bool) -> None:
    """Under DeepSpeed with manual optimization (GRPO, PPO), mark whether the next backward ends an optimizer
    step. Lightning sets DeepSpeed's accumulation to ``accumulate_grad_batches`` (1 under manual optimization),
    so without this the engine treats every micro-batch's backward as the last of a step, and a step of several
    micro-batches does not get their summed gradient (tests/distributed checks it against one process).
    No-op otherwise."""
    trainer = getattr(module, "_trainer", None)
    strategy = trainer.strategy if trainer is not None else None
    engine = getattr(strategy, "model", None) if isinstance(strategy, DeepSpeedStrategy) else None
    if engine is not None and hasattr(engine, "set_gradient_accumulation_boundary"):
        engine.set_gradient_accumulation_boundary(is_boundary)


def parameters_sharded(strategy) -> bool:
    """Whether ``strategy`` keeps only a shard of each parameter on a rank (FSDP2, ZeRO-3)."""
    return isinstance(strategy, ModelParallelStrategy) or (
        isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3)


@contextmanager
def generation_context(module) -> Iterator[Optional[Callable[[bool], bool]]]:
    """Around sampling from ``module.policy``: yields the ``sync_stop`` hook the sampler needs, or ``None``.

    - DDP, ZeRO-1/2, one process: parameters are whole on every rank; nothing to do (``None``).
    - FSDP2: the policy's language model is gathered once for the rollout (:func:`fsdp2_full_parameters`);
      decoding then needs no collective, so ranks may stop at different steps (``None``). Memory: one full
      copy of the policy during generation, as any forward would hold layer by layer.
    - ZeRO-3: DeepSpeed gathers each layer on use and releases it after, so every rank must run the same
      number of decoding steps: the hook and-s the "all rows finished" flag across ranks (one all-reduce of
      a scalar per step), and a rank whose rows are done keeps decoding padding until all ranks are done.
    """
    trainer = getattr(module, "_trainer", None)
    strategy = trainer.strategy if trainer is not None else None
    if strategy is None or trainer.world_size == 1 or not parameters_sharded(strategy):
        yield None
    elif isinstance(strategy, ModelParallelStrategy):
        policy = module.policy
        reshard = strategy.reshard_after_forward if isinstance(strategy, FSDP2Strategy) else True
        with fsdp2_full_parameters(policy, policy.model, reshard):
            yield None
    else:
        device = module.device
        try:
            yield lambda done: global_all(done, device)
        finally:
            # The sampler runs in inference mode, so parameters DeepSpeed gathered there (and may keep cached for
            # reuse) are inference tensors that autograd refuses; release them all, and training gathers anew.
            engine = strategy.model
            if hasattr(engine, "empty_partition_cache"):
                engine.empty_partition_cache()
            # DeepSpeed also released each module's gathered weights after its forward inside inference mode, so the
            # empty placeholder each parameter now holds is an inference tensor too. A parameter that the next
            # backward does not use (the policy during PPO's value-only update with a separate critic) keeps it,
            # and DeepSpeed's count of the parameters in that backward fails on it: give each an ordinary one.
            for param in module.parameters():
                if param.is_inference():
                    param.data = param.data.clone()


class DeepSpeedZeROStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054) that also runs on CPU with gloo.

    On CUDA it is Lightning's ``DeepSpeedStrategy`` unchanged. On CPU: the environment is set up as for DDP,
    DeepSpeed's distributed backend is initialised directly, and each process passes its local rank as its
    device rank.
    """

    def __init__(self, stage: Literal[1, 2, 3] = 2, offload_optimizer: bool = False, offload_parameters: bool = False,
                 param_persistence_threshold: int | None = None, **kwargs):
        """
        Args:
            stage: ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters.
            offload_optimizer: Keep optimizer state in CPU memory (ZeRO-Offload).
            offload_parameters: Keep parameters in CPU memory (stage 3 only).
            param_persistence_threshold: Stage 3: parameters with fewer elements stay whole on every rank
                (DeepSpeed's ``stage3_param_persistence_threshold``; null keeps its default, 1e5).
        """
        # DeepSpeed only uses the micro-batch size for its throughput log; the automatic choice would build the
        # training dataloader, which does not exist yet when ``trainer.validate`` runs before ``fit``.
        kwargs.setdefault("logging_batch_size_per_gpu", 1)
        super().__init__(stage=stage, offload_optimizer=offload_optimizer, offload_parameters=offload_parameters,
                         **kwargs)
        if param_persistence_threshold is not None:
            self.config.setdefault("zero_optimization", {})["stage3_param_persistence_threshold"] = \
                int(param_persistence_threshold)
        if offload_optimizer or offload_parameters:
            # Let a torch optimizer (the modules' AdamW) run on offloaded state; DeepSpeedCPUAdam is faster.
            self.config.setdefault("zero_force_ds_cpu_optimizer", False)

    def _format_batch_size_and_grad_accum_config(self) -> None:
        super()._format_batch_size_and_grad_accum_config()
        # Lightning's clip_gradients is a no-op under DeepSpeed (the engine clips), and the engine reads the clip
        # value from ``trainer.gradient_clip_val`` only. Manual-optimization modules (GRPO, PPO) set theirs as
        # ``updates.max_grad_norm``: hand it to the engine.
        module = self.lightning_module
        clip = getattr(getattr(module, "updates", None), "max_grad_norm", None)
        if module is not None and not module.automatic_optimization and clip and not self.config.get("gradient_clipping"):
            self.config["gradient_clipping"] = float(clip)

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

    def _initialize_deepspeed_train(self, model) -> None:
        if self.zero_stage_3 and any(hasattr(p, "ds_id") for p in model.parameters()):
            # An earlier engine (``trainer.validate`` before ``fit``, as the CLI does) left its ZeRO-3 hooks on the
            # modules; with a second set from the training engine, DeepSpeed's prefetch trace breaks ("pop from an
            # empty deque"). Lightning clears them before a validation engine; do the same before training.
            from lightning.pytorch.strategies.deepspeed import remove_module_hooks

            remove_module_hooks(model)
        super()._initialize_deepspeed_train(model)

    def _initialize_deepspeed_inference(self, model) -> None:
        # Validation or prediction without fit (the CLI validates before fit): the same engine as Lightning's,
        # with this process's local rank as the device rank (a CPU device has no index).
        if not self._on_cpu():
            return super()._initialize_deepspeed_inference(model)
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        config = {"train_micro_batch_size_per_gpu": 1}
        config.update({k: self.config[k] for k in ("fp16", "bf16") if k in self.config})
        if self.zero_stage_3:
            config.update({k: self.config[k] for k in ("zero_allow_untested_optimizer", "zero_optimization")})
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank), config=config, model=model, optimizer=None,
            lr_scheduler=None, model_parameters=[], dist_init_required=False)

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


def _register_names() -> None:
    names = {
        "fsdp2": (FSDP2Strategy, "FSDP2: per-decoder-layer fully_shard, pure data parallel", {}),
        "fsdp2_offload": (FSDP2Strategy, "FSDP2 with parameters and optimizer state in CPU memory",
                          {"cpu_offload": True}),
        "zero1": (DeepSpeedZeROStrategy, "DeepSpeed ZeRO stage 1 (CPU-capable)", {"stage": 1}),
        "zero2": (DeepSpeedZeROStrategy, "DeepSpeed ZeRO stage 2 (CPU-capable)", {"stage": 2}),
        "zero2_offload": (DeepSpeedZeROStrategy, "DeepSpeed ZeRO stage 2, optimizer state in CPU memory",
                          {"stage": 2, "offload_optimizer": True}),
        "zero3": (DeepSpeedZeROStrategy, "DeepSpeed ZeRO stage 3 (CPU-capable)", {"stage": 3}),
        "zero3_offload": (DeepSpeedZeROStrategy, "DeepSpeed ZeRO stage 3, parameters and optimizer state in CPU memory",
                          {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
    }
    for name, (cls, description, params) in names.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=description, **params)


_register_names()

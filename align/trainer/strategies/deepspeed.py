"""DeepSpeed ZeRO under Lightning, on CUDA and on CPU (gloo), and the accumulation boundary that manual
optimization must tell the engine."""

from __future__ import annotations

import argparse
from typing import Literal

from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from align.errors import AlignConfigError


class DeepSpeedZeROStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054) that also runs on CPU with gloo.

    On CUDA it is Lightning's ``DeepSpeedStrategy`` unchanged. On CPU: the environment is set up as for DDP,
    DeepSpeed's distributed backend is initialised directly, and each process passes its local rank as its
    device rank.
    """

    def __init__(
        self,
        stage: Literal[1, 2, 3] = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        param_persistence_threshold: int | None = None,
        **kwargs,
    ):
        """
        Args:
            stage: ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters.
            offload_optimizer: Keep optimizer state in CPU memory (ZeRO-Offload).
            offload_parameters: Keep parameters in CPU memory (stage 3 only).
            param_persistence_threshold: Stage 3: parameters with fewer elements stay whole on every rank
                (DeepSpeed's ``stage3_param_persistence_threshold``; null keeps its default, 1e5).
        """
        if stage not in (1, 2, 3):
            raise AlignConfigError(f"trainer.strategy.stage: expected 1, 2 or 3, got {stage!r}")
        if param_persistence_threshold is not None and not (
            isinstance(param_persistence_threshold, int)
            and not isinstance(param_persistence_threshold, bool)
            and param_persistence_threshold >= 0
        ):
            raise AlignConfigError(
                f"trainer.strategy.param_persistence_threshold: expected an integer >= 0 or null, "
                f"got {param_persistence_threshold!r}"
            )
        # DeepSpeed only uses the micro-batch size for its throughput log; the automatic choice would build the
        # training dataloader, which does not exist yet when ``trainer.validate`` runs before ``fit``.
        kwargs.setdefault("logging_batch_size_per_gpu", 1)
        super().__init__(
            stage=stage, offload_optimizer=offload_optimizer, offload_parameters=offload_parameters, **kwargs
        )
        assert self.config is not None  # Lightning's __init__ loads or creates one
        if param_persistence_threshold is not None:
            self.config.setdefault("zero_optimization", {})["stage3_param_persistence_threshold"] = int(
                param_persistence_threshold
            )
        if offload_optimizer or offload_parameters:
            # Let a torch optimizer (the modules' AdamW) run on offloaded state; DeepSpeedCPUAdam is faster.
            self.config.setdefault("zero_force_ds_cpu_optimizer", False)

    def _format_batch_size_and_grad_accum_config(self) -> None:
        super()._format_batch_size_and_grad_accum_config()
        # Lightning's clip_gradients is a no-op under DeepSpeed (the engine clips), and the engine reads the clip
        # value from ``trainer.gradient_clip_val`` only. Manual-optimization modules (GRPO, PPO) set theirs as
        # ``updates.max_grad_norm``: hand it to the engine.
        assert self.config is not None  # made in __init__
        module = self.lightning_module
        clip = getattr(getattr(module, "updates", None), "max_grad_norm", None)
        if (
            module is not None
            and not module.automatic_optimization
            and clip
            and not self.config.get("gradient_clipping")
        ):
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

        assert self.config is not None  # made in __init__
        config = {"train_micro_batch_size_per_gpu": 1}
        config.update({k: self.config[k] for k in ("fp16", "bf16") if k in self.config})
        if self.zero_stage_3:
            config.update({k: self.config[k] for k in ("zero_allow_untested_optimizer", "zero_optimization")})
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )

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


def accumulation_boundary(module, is_boundary: bool) -> None:
    """Under DeepSpeed with manual optimization (GRPO, PPO), mark whether the next backward ends an optimizer
    step. Lightning sets DeepSpeed's accumulation to ``accumulate_grad_batches`` (1 under manual optimization),
    so without this the engine treats every micro-batch's backward as the last of a step, and a step of several
    micro-batches does not get their summed gradient (tests/trainer/strategies checks it against one process).
    No-op otherwise."""
    trainer = getattr(module, "_trainer", None)
    strategy = trainer.strategy if trainer is not None else None
    engine = getattr(strategy, "model", None) if isinstance(strategy, DeepSpeedStrategy) else None
    if engine is not None and hasattr(engine, "set_gradient_accumulation_boundary"):
        engine.set_gradient_accumulation_boundary(is_boundary)

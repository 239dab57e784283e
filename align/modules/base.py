"""Shared LightningModule plumbing: the policy, optimizer and scheduler callables, checkpoint metadata."""

from __future__ import annotations


import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from align.models.policy import PolicyModel
from align.optim import WarmupLR


def param_groups(module: torch.nn.Module) -> list[dict]:
    """Weight decay on matrices only: biases, norms and other vectors are not decayed."""
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            # A parameter already partitioned by DeepSpeed ZeRO-3 (an earlier validation engine) holds an empty
            # local tensor; its real shape is ``ds_shape``.
            ndim = len(getattr(p, "ds_shape", p.shape))
            (decay if ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


class AlignModule(L.LightningModule):
    """Base of every algorithm module. Subclasses set ``headline_metrics``: what the CLI prints before and after."""

    headline_metrics: tuple[str, ...] = ()

    def __init__(
        self,
        policy: PolicyModel,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
        disable_dropout: bool = False,
    ):
        super().__init__()
        self.policy = policy
        self.optimizer = optimizer
        self.scheduler = scheduler
        if disable_dropout:
            policy.disable_dropout()

    @property
    def tokenizer(self):
        return self.policy.tokenizer

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum across data-parallel ranks (identity on one process)."""
        if self._trainer is None or self.trainer.world_size == 1:
            return value
        return self.trainer.strategy.reduce(value.detach().clone(), reduce_op="sum")

    def gradient_scale(self) -> float:
        """The factor that undoes the framework's own loss scaling, so a loss divided by a global count is exact.

        Lightning divides each micro-batch loss by ``accumulate_grad_batches``; DeepSpeed's engine divides by it
        once more; data-parallel gradient averaging divides by the world size. A module that divides its summed
        loss by the count over the whole optimizer step multiplies by this factor.
        """
        trainer = self.trainer
        scale = trainer.accumulate_grad_batches * trainer.world_size
        if trainer.strategy.handles_gradient_accumulation:
            scale *= trainer.accumulate_grad_batches
        return float(scale)

    def accumulating(self) -> bool:
        """Whether the current micro-batch does not end an optimizer step although the optimizer hooks run.

        Under DeepSpeed (which accumulates gradients itself) Lightning calls ``optimizer.step`` and
        ``on_before_optimizer_step`` after *every* micro-batch; the engine only updates at the window's end.
        Per-step bookkeeping (the window's loss, tokens/s) must wait for that end.
        """
        trainer = self._trainer
        return bool(trainer is not None and trainer.strategy.handles_gradient_accumulation
                    and trainer.fit_loop._should_accumulate())

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        from align.strategies import unshard_root

        unshard_root(self.policy)  # FSDP2: for code that enters the model below the root (no-op otherwise)

    def on_validation_batch_start(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        from align.strategies import unshard_root

        unshard_root(self.policy)

    def configure_model(self) -> None:
        # FSDP2: shard per decoder layer, then the policy (reference and critic included).
        from lightning.pytorch.strategies import ModelParallelStrategy

        if isinstance(self.trainer.strategy, ModelParallelStrategy) and not getattr(self, "_fsdp_applied", False):
            from align.strategies import apply_fsdp2

            apply_fsdp2(self.policy, self.trainer.strategy)
            self._fsdp_applied = True

    def configure_optimizers(self):
        return self.with_scheduler(self.optimizer(param_groups(self)))

    def with_scheduler(self, optimizer: torch.optim.Optimizer):
        """``configure_optimizers``' return value for ``optimizer`` and the module's scheduler, stepped every
        optimizer step (a :class:`~align.optim.WarmupLR` without total steps gets the trainer's)."""
        if self.scheduler is None:
            return optimizer
        scheduler = self.scheduler(optimizer)
        if isinstance(scheduler, WarmupLR) and scheduler.total_steps is None:
            scheduler.total_steps = int(self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_callbacks(self):
        """Exact resume (RNG states, dataloader position, atomic checkpoint writes) and the non-finite guard
        (policy ``error``), unless the trainer already has callbacks of those types."""
        from align.checkpointing import ExactResume
        from align.guards import NonFiniteGuard

        present = tuple(type(cb) for cb in (self.trainer.callbacks if self._trainer is not None else []))
        return [cb() for cb in (ExactResume, NonFiniteGuard) if not any(issubclass(t, cb) for t in present)]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Enough to rebuild the policy without the run's config (see ``align export``).
        checkpoint["align"] = {"policy": self.policy.spec, "module": type(self).__name__}

"""Numerical guards: a non-finite loss or gradient never reaches the weights.

:class:`NonFiniteGuard` watches every loss passed to backward and, before each optimizer step, the gradients
of every parameter the optimizer updates. When any of them is NaN or infinite:

* ``policy="error"`` (default) stops the run with :class:`NonFiniteError`, naming the optimizer step, epoch and
  batch, whether the loss or the gradients were bad and the first parameters affected. The step is not taken,
  so the weights and optimizer state are those of the previous step.
* ``policy="skip"`` drops the update: every gradient is cleared before ``optimizer.step()``, and PyTorch's
  optimizers leave a parameter without a gradient untouched (no moment update, no weight decay, no step
  count). The learning-rate schedule and ``global_step`` still advance. Skipped steps are counted in
  ``train/nonfinite_skipped`` (logged once the first one happens, saved in checkpoints).

With fp16 mixed precision, gradient overflow is left to the gradient scaler (it skips those steps and lowers
its scale); only the loss is checked. Works for automatic and manual optimization (Lightning calls both hooks from
``manual_backward`` and ``optimizer.step()``). Under data parallelism the verdict is all-reduced, so every rank skips or
stops together even when gradients are sharded.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from align.errors import AlignConfigError, AlignError

log = logging.getLogger(__name__)

Policy = Literal["error", "skip"]


class NonFiniteError(AlignError):
    """A loss or gradient was NaN or infinite; the update was not applied."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP2) -> this rank's shard


def nonfinite_parameters(params: list[torch.nn.Parameter]) -> list[int]:
    """Indices of ``params`` whose gradient holds a NaN or an infinity."""
    return [i for i, p in enumerate(params) if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all())]


class NonFiniteGuard(Callback):
    """Stops or skips an optimizer step whose loss or gradients are not finite (see the module docstring)."""

    def __init__(self, policy: Policy = "error"):
        """``policy``: ``error`` (stop, naming the step) or ``skip`` (drop the update and count it)."""
        if policy not in ("error", "skip"):
            raise AlignConfigError(
                f"trainer.callbacks.policy: expected 'error' or 'skip' (NonFiniteGuard's policy), got {policy!r}"
            )
        self.policy = policy
        self.skipped = 0
        self._loss_finite: torch.Tensor | None = None

    @property
    def state_key(self) -> str:
        return "NonFiniteGuard"

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        finite = torch.isfinite(loss.detach()).all()  # no host sync here: checked once per optimizer step
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        loss_finite, self._loss_finite = self._loss_finite, None
        # fp16 mixed precision: the gradient scaler skips overflowing steps and lowers its scale by design.
        scaled = getattr(trainer.precision_plugin, "scaler", None) is not None
        grads = [] if scaled else [_local(p.grad) for p in params]
        if grads:
            norms = torch._foreach_norm(grads) if hasattr(torch, "_foreach_norm") else [g.norm() for g in grads]
            grads_finite = torch.isfinite(torch.stack([n.float().to(grads[0].device) for n in norms]).sum())
        else:
            grads_finite = torch.tensor(True)
        bad = torch.stack(
            [~grads_finite.cpu(), ~(loss_finite.cpu() if loss_finite is not None else torch.tensor(True))]
        ).float()  # (2,): grads, loss
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce(bad.to(pl_module.device), reduce_op="sum").cpu()
        if not bool(bad.any()):
            if self.skipped and self.policy == "skip":
                pl_module.log(
                    "train/nonfinite_skipped", float(self.skipped), on_step=True, on_epoch=False, batch_size=1
                )
            return
        what = " and ".join(w for w, b in (("loss", bad[1]), ("gradients", bad[0])) if b > 0)
        where = (
            f"optimizer step {trainer.global_step} (epoch {trainer.current_epoch}, "
            f"batch {trainer.fit_loop.epoch_loop.batch_idx})"
        )
        if self.policy == "error":
            names = {id(p): n for n, p in pl_module.named_parameters()}
            first = [names.get(id(params[i]), f"#{i}") for i in nonfinite_parameters(params)[:3]]
            detail = f"; first parameters with non-finite gradients: {', '.join(first)}" if first else ""
            raise NonFiniteError(
                f"non-finite {what} at {where}{detail}. The update was not applied, so the weights are those of the "
                "previous step. Lower the learning rate, check the data and rewards of this batch, or set the "
                "guard's policy to 'skip' to drop such updates"
            )
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        self.skipped += 1
        log.warning("non-finite %s at %s: update skipped (%d so far)", what, where, self.skipped)
        pl_module.log("train/nonfinite_skipped", float(self.skipped), on_step=True, on_epoch=False, batch_size=1)


__all__ = ["NonFiniteError", "NonFiniteGuard", "Policy", "nonfinite_parameters"]

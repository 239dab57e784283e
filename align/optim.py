"""Schedules and parameter updates around the optimizer: linear warmup followed by cosine, linear or constant
decay of the learning rate; a linear schedule of any value (DQN's exploration rate); Polyak averaging of a target
network; gradient-norm clipping for small networks."""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


class WarmupLR(LambdaLR):
    """Linear warmup from 0 over ``warmup_steps``, then ``decay`` to ``min_lr_ratio`` of the peak by ``total_steps``.

    ``total_steps=None`` is filled in from the trainer (``estimated_stepping_batches``) when the module
    configures its optimizers, so YAML need not repeat ``max_steps``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_steps: int = 0,
        total_steps: int | None = None,
        decay: Literal["cosine", "linear", "constant"] = "cosine",
        min_lr_ratio: float = 0.0,
    ):
        if decay not in ("cosine", "linear", "constant"):
            raise ValueError(f"decay: expected 'cosine', 'linear' or 'constant', got {decay!r}")
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.decay = decay
        self.min_lr_ratio = min_lr_ratio
        super().__init__(optimizer, self._factor)

    def _factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.decay == "constant" or not self.total_steps:
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if self.decay == "cosine" else 1 - progress
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * shape

    def state_dict(self):
        # The schedule is a bound method; keep only plain settings and counters.
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_lambdas")}

    def load_state_dict(self, state_dict):
        self.__dict__.update(state_dict)


def linear_schedule(step: int | float, start: float, end: float, duration: int | float) -> float:
    """``start`` moving linearly to ``end`` over ``duration`` steps, then ``end``: DQN's epsilon (arXiv 1312.5602
    anneals 1.0 to 0.1 over its first million frames). ``duration <= 0`` is ``end`` from the start."""
    if duration <= 0:
        return float(end)
    fraction = min(max(float(step) / float(duration), 0.0), 1.0)
    return float(start + fraction * (end - start))


@torch.no_grad()
def polyak_update(target: torch.nn.Module, online: torch.nn.Module, tau: float) -> None:
    """``target <- tau * online + (1 - tau) * target`` for every parameter and floating buffer (Lillicrap et al.
    2015, arXiv 1509.02971); ``tau = 1`` is the hard copy of DQN's target network (arXiv 1312.5602)."""
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"polyak_update: tau must be in (0, 1], got {tau}")
    pairs = list(zip(target.parameters(), online.parameters()))
    pairs += [(t, o) for t, o in zip(target.buffers(), online.buffers()) if t.is_floating_point()]
    targets, sources = [t for t, _ in pairs], [o for _, o in pairs]
    if tau == 1.0:
        torch._foreach_copy_(targets, sources)
    else:
        torch._foreach_lerp_(targets, sources, tau)


@torch.no_grad()
def clip_grad_norm(parameters: Sequence[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that their global L2 norm is at most ``max_norm`` (``None``: leave
    them); returns the norm before scaling, a 0-dim tensor.

    The arithmetic of ``torch.nn.utils.clip_grad_norm_`` (the coefficient ``max_norm / (norm + 1e-6)``, capped at
    1), without its per-call grouping of the gradients by device and dtype when they share one: a classic-RL
    network's optimizer step takes a few hundred microseconds, and that grouping was a fifth of it. Gradients on
    several devices or dtypes go to torch's function."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if any(g.device != grads[0].device or g.dtype != grads[0].dtype for g in grads):
        return torch.nn.utils.clip_grad_norm_(parameters, float("inf") if max_norm is None else max_norm)
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if max_norm is not None:
        coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
        # A factor of exactly 1 changes nothing: on the CPU, where reading it costs no device sync, the pass over
        # every gradient is skipped then (most steps of a classic-RL run are not clipped).
        if grads[0].device.type != "cpu" or float(coefficient) < 1.0:
            torch._foreach_mul_(grads, coefficient)
    return total

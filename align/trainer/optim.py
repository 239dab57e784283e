"""The learning-rate schedule of the language-model configs: linear warmup followed by cosine, linear or constant
decay (:class:`WarmupLR`). The classic-RL wing's schedules and optimizer steps are in :mod:`align.gym.optim`."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from align.errors import AlignConfigError


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class WarmupLR(LambdaLR):
    """Linear warmup from 0 over ``warmup_steps``, then ``decay`` to ``min_lr_ratio`` of the peak by ``total_steps``.

    ``total_steps=None`` is filled in from the trainer (``estimated_stepping_batches``) when the module
    configures its optimizers, so YAML need not repeat ``max_steps``.
    """

    where: ClassVar[str] = "model.scheduler"
    """The settings' place in a config, named by their errors."""

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_steps: int = 0,
        total_steps: int | None = None,
        decay: Literal["cosine", "linear", "constant"] = "cosine",
        min_lr_ratio: float = 0.0,
    ):
        for name, ok, expected, got in (
            ("warmup_steps", _integer(warmup_steps) and warmup_steps >= 0, "an integer >= 0", warmup_steps),
            (
                "total_steps",
                total_steps is None or (_integer(total_steps) and total_steps >= 1),
                "an integer >= 1 or null (the trainer's)",
                total_steps,
            ),
            ("decay", decay in ("cosine", "linear", "constant"), "'cosine', 'linear' or 'constant'", decay),
            (
                "min_lr_ratio",
                isinstance(min_lr_ratio, (int, float))
                and not isinstance(min_lr_ratio, bool)
                and 0 <= min_lr_ratio <= 1,
                "a value in [0, 1]",
                min_lr_ratio,
            ),
        ):
            if not ok:
                raise AlignConfigError(f"{self.where}.{name}: expected {expected}, got {got!r}")
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

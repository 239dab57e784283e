"""The critic's pass over a rollout, kept with its graph for the update's first micro-batch.

PPO scores a rollout with the critic (the values of GAE), then its first optimizer step runs the critic again over
the rows of its first micro-batch, with the same weights and inputs, to get those values with gradients. With the
first epoch's minibatches drawn as the rollout is scored (:meth:`Learner.plan`, the same random
draw the update would make), the scoring pass runs those rows with gradients and the first step reads them:
one critic forward pass fewer per rollout (a quarter of them at 2 epochs x 2 minibatches).

It applies to a separate critic (a shared value head's values come from the policy pass the step runs anyway),
on one process (DDP, FSDP and DeepSpeed run their own hooks around a module's forward and backward). The graph
is held from the scoring to the first step; the step's own activations are the same size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from align.modules.learner import RLBatch
from align.rollout.types import Rollout

if TYPE_CHECKING:
    from align.modules.rl import RLModule


class KeptCriticPass:
    """Rollout values whose first micro-batch keeps its graph (:meth:`values`), read back once (:meth:`take`)."""

    def __init__(self) -> None:
        self._kept: tuple[torch.Tensor, torch.Tensor] | None = None

    def values(self, module: RLModule, rollout: Rollout, keep: bool = True) -> torch.Tensor:
        """``(N, R)`` values of the rollout's rows under ``module``'s critic; keeps the first micro-batch's
        graph where that applies (``keep`` and the module docstring's conditions)."""
        from lightning.pytorch.strategies import SingleDeviceStrategy

        policy, padding_free = module.policy, module.updates.padding_free
        R = rollout.response_mask.shape[1]
        values_of = lambda ids, mask, width: policy.values(ids, mask, response_length=width, padding_free=padding_free)
        self._kept = None
        one_process = module._trainer is None or isinstance(module.trainer.strategy, SingleDeviceStrategy)
        if not (keep and policy.critic is not None and policy.critic.separate and one_process):
            return values_of(rollout.input_ids, rollout.attention_mask, R)
        widths = (RLBatch.row_widths(rollout.attention_mask, R)
                  if module.updates.max_tokens_per_microbatch is not None else None)
        first = module.learner.plan(len(rollout), widths)[0][0]
        width = RLBatch.selected_width(rollout.attention_mask, R, first)
        columns = rollout.input_ids.shape[1] - (R - width)  # trimmed as RLBatch.select trims the micro-batch
        rest = torch.ones(len(rollout), dtype=torch.bool, device=rollout.input_ids.device)
        rest[first] = False
        with torch.enable_grad():
            kept = values_of(rollout.input_ids[first, :columns], rollout.attention_mask[first, :columns], width)
        values = torch.zeros(len(rollout), R, dtype=kept.dtype, device=kept.device)
        values[first, :width] = kept.detach()
        if bool(rest.any()):
            values[rest] = values_of(rollout.input_ids[rest], rollout.attention_mask[rest], R)
        self._kept = (first, kept)
        return values

    def take(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """The kept ``(n, width)`` values with their graph when ``rows`` (the update's current micro-batch,
        :attr:`Learner.current_rows`) are the kept ones; None otherwise. Either way nothing stays kept."""
        kept, self._kept = self._kept, None
        return kept[1] if kept is not None and kept[0] is rows else None

    def clear(self) -> None:
        self._kept = None


__all__ = ["KeptCriticPass"]

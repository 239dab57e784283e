"""The critic's pass over a rollout, its first micro-batch kept with its graph for the update.

PPO scores a rollout with the critic (the values of GAE), then its first optimizer step runs the critic again over
the rows of its first micro-batch, with the same weights and inputs, to get those values with gradients. With the
first epoch's minibatches drawn as the rollout is scored (:meth:`~align.modules.learner.Learner.plan`, the same
random draw the update would make, handed to that update), the scoring pass runs those rows with gradients and the
first step reads them: one critic forward pass fewer per rollout (a quarter of them at 2 epochs x 2 minibatches).

What is kept is data: :class:`KeptValues` holds the rows it scored and their values, and gives them to the first
micro-batch whose ``rows`` are the same rows (:meth:`KeptValues.take`), once. It applies to a separate critic (a
shared value head's values come from the policy pass the step runs anyway), on one process (DDP, FSDP and DeepSpeed
run their own hooks around a module's forward and backward); the module decides. The graph is held from the scoring
to the first step; the step's own activations are the same size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from align.models.scorer import Rows, Scorer
from align.modules.learner import RLBatch
from align.rollout.types import Rollout

__all__ = ["KeptValues", "critic_values"]


@dataclass
class KeptValues:
    """The critic's values of some rows of a rollout, with their graph, for the update's first micro-batch."""

    rows: torch.Tensor  # (n,) long: the rollout's rows
    values: torch.Tensor | None  # (n, width) values with their graph; None once taken

    def take(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """The kept values when ``rows`` (a micro-batch's rows of the rollout) are the kept rows, in order; None
        otherwise. The first call takes them either way: the graph is of the weights before the first step."""
        values, self.values = self.values, None
        if values is None or rows is None or not torch.equal(rows.to(self.rows.device), self.rows):
            return None
        return values


def critic_values(
    scorer: Scorer,
    rollout: Rollout,
    first: torch.Tensor | None = None,
) -> tuple[torch.Tensor, KeptValues | None]:
    """``(N, R)`` values of the rollout's rows under the scorer's critic, detached, and, when ``first`` names the
    rows of the update's first micro-batch (``plan[0][0]``), those rows' values with their graph."""
    R = rollout.response_mask.shape[1]
    if first is None:
        return scorer.values(rollout), None
    width = RLBatch.selected_width(rollout.attention_mask, R, first)
    columns = rollout.input_ids.shape[1] - (R - width)  # trimmed as RLBatch.select trims the micro-batch
    rest = torch.ones(len(rollout), dtype=torch.bool, device=rollout.input_ids.device)
    rest[first] = False
    with torch.enable_grad():
        kept = scorer.values(
            Rows(
                rollout.input_ids[first, :columns],
                rollout.attention_mask[first, :columns],
                rollout.response_mask[first, :width],
            )
        )
    values = torch.zeros(len(rollout), R, dtype=kept.dtype, device=kept.device)
    values[first, :width] = kept.detach()
    if bool(rest.any()):
        values[rest] = scorer.values(
            Rows(rollout.input_ids[rest], rollout.attention_mask[rest], rollout.response_mask[rest])
        )
    return values, KeptValues(first, kept)

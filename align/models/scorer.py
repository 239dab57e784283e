"""The :class:`Scorer`: the one owner of how rows are scored under a policy.

Every module scores through one scorer: the RL modules (current, old and reference log-probs, entropies, values, the
whole next-token distributions of GKD), the preference modules (summed response log-probs of DPO's and KTO's pairs),
the reward model (a score at each sequence's last token) and SFT (log-probs of given targets). The scorer holds the
settings every such pass must share, so that the log-probs of the old and the new policy, and of the reference, are
computed the same way (docs/algorithms.md, "Log-probs for old and new policy"):

* ``temperature``: the log-softmax of ``logits / temperature`` (an RL module's sampling temperature, 1 for greedy and
  for the preference modules);
* ``padding_free``: the rows' real tokens laid end to end instead of the padded rows (the same numbers to float
  rounding, without the arithmetic of the padding).

A pass goes module -> scorer -> :mod:`align.models.scoring` -> :mod:`align.core.logprobs`. The scorer calls the
policy's own scoring methods (:meth:`~align.models.policy.PolicyModel.token_logprobs` and its siblings), which are
one-line entries into :mod:`align.models.scoring`: FSDP2 gathers the policy's root parameters around them as it does
around ``forward`` (:func:`align.trainer.strategies.apply_fsdp2`).

Rows are anything with ``input_ids`` ``(N, T)``, ``attention_mask`` ``(N, T)`` and ``response_mask`` ``(N, R)``: a
:class:`~align.rollout.types.Rollout`, an RL batch, or :class:`Rows` built on the spot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from align.core.masks import masked_sum
from align.core.packing import pack_scored_rows
from align.models.policy import PolicyModel, TokenLogprobs
from align.models.reward import sequence_scores

if TYPE_CHECKING:
    from align.data.preference import PreferenceBatch

__all__ = ["Rows", "ScoredRows", "Scorer"]


class ScoredRows(Protocol):
    """Rows to score: prompt and response tokens, and which response tokens count."""

    @property
    def input_ids(self) -> torch.Tensor: ...  # (N, T) left-padded prompt + response

    @property
    def attention_mask(self) -> torch.Tensor: ...  # (N, T)

    @property
    def response_mask(self) -> torch.Tensor: ...  # (N, R) the last R columns are the response


class Rows(NamedTuple):
    """:class:`ScoredRows` built from tensors (a subset of a rollout's rows, say)."""

    input_ids: torch.Tensor  # (N, T)
    attention_mask: torch.Tensor  # (N, T)
    response_mask: torch.Tensor  # (N, R)


@dataclass
class Scorer:
    """Scores rows under ``policy`` (and its reference and critic) at ``temperature``, padding-free or not."""

    policy: PolicyModel
    temperature: float = 1.0
    """Temperature of every log-prob: ``logits / temperature`` before the log-softmax (GKD's logits are returned raw
    and tempered by the loss)."""
    padding_free: bool = False
    """Score the rows' real tokens laid end to end (:func:`align.core.packing.pack_scored_rows`)."""

    # ------------------------------------------------------------------ RL rows
    def logprobs(self, rows: ScoredRows, *, entropy: bool = False, values: bool = False) -> TokenLogprobs:
        """``(N, R)`` log-probs of the response tokens of ``rows`` under the policy, with gradients; the entropy of
        each position's distribution and the critic's values when asked (from the same pass where they can be)."""
        return self.policy.token_logprobs(
            rows.input_ids,
            rows.attention_mask,
            response_length=rows.response_mask.shape[1],
            temperature=self.temperature,
            return_entropy=entropy,
            return_values=values,
            padding_free=self.padding_free,
        )

    @torch.no_grad()
    def reference_logprobs(self, rows: ScoredRows) -> torch.Tensor:
        """``(N, R)`` log-probs of the response tokens under the reference (``policy.setup_reference()`` first)."""
        return self.policy.token_logprobs(
            rows.input_ids,
            rows.attention_mask,
            response_length=rows.response_mask.shape[1],
            temperature=self.temperature,
            reference=True,
            padding_free=self.padding_free,
        ).logprobs

    def values(self, rows: ScoredRows, *, detach_backbone: bool = False) -> torch.Tensor:
        """``(N, R)`` float32 values of the critic before each response token; ``detach_backbone``: a shared head's
        backbone runs without gradients (a value-only update that must leave the policy as it is)."""
        return self.policy.values(
            rows.input_ids,
            rows.attention_mask,
            response_length=rows.response_mask.shape[1],
            detach_backbone=detach_backbone,
            padding_free=self.padding_free,
        )

    def response_logits(self, rows: ScoredRows, *, reference: bool = False) -> torch.Tensor:
        """``(N, R, V)`` raw logits of the positions that predict the response tokens (GKD); ``reference``: under
        the reference (the distillation teacher)."""
        return self.policy.response_logits(
            rows.input_ids, rows.attention_mask, response_length=rows.response_mask.shape[1], reference=reference
        )

    # ------------------------------------------------------------------ sequences
    def sequence_logps(self, batch: PreferenceBatch, *, reference: bool = False) -> torch.Tensor:
        """``(2B,)`` summed response log-probs of every row of a preference batch (chosen then rejected, or
        completions then KTO's mismatched ones) from one forward pass; ``reference``: under the reference."""
        ids, mask = batch.input_ids, batch.attention_mask
        if self.padding_free:
            prompt = torch.zeros_like(mask[:, : ids.shape[1] - batch.response_length])
            packed = pack_scored_rows(ids, mask, torch.cat([prompt, batch.response_mask], dim=1))
            logps = self.policy.next_token_logprobs(
                packed.input_ids,
                packed.targets,
                position_ids=packed.position_ids,
                temperature=self.temperature,
                reference=reference,
            )
            return packed.row_sums(logps)
        scores = self.policy.token_logprobs(
            ids, mask, response_length=batch.response_length, temperature=self.temperature, reference=reference
        )
        return masked_sum(scores.logprobs, batch.response_mask, dim=-1)

    def target_logprobs(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(K,)`` log-probs of ``targets`` ``(B, T)`` at the positions that have one (``-100`` elsewhere), in
        row-major order (SFT; ``position_ids`` for packed rows)."""
        return self.policy.next_token_logprobs(
            input_ids, targets, attention_mask=attention_mask, position_ids=position_ids, temperature=self.temperature
        )

    def sequence_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(N,)`` the reward model's scalar score of each row, read at its last real token
        (:func:`align.models.reward.sequence_scores`)."""
        return sequence_scores(self.policy, input_ids, attention_mask, padding_free=self.padding_free)

"""Rollouts of given completions: a dataset's reference answers laid out as if the policy had sampled them, for the
updates that mix the policy's own samples with fixed targets (GKD's ``lmbda < 1``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from align.data.prompts import PromptBatch
from align.errors import AlignConfigError, AlignDataError
from align.rollout.sampling import left_pad
from align.rollout.types import Rollout

__all__ = ["given_rollout"]


def given_rollout(policy, batch: PromptBatch, column: str, max_new_tokens: int) -> Rollout:
    """One row per prompt of ``batch`` whose response is the text of its ``column`` (tokenized without special
    tokens, then the EOS token), cut at ``max_new_tokens`` like a sampled response (then ``truncated``). The
    sampling log-probs are 0 (no policy sampled them). Fails on one line naming the column when a row lacks it."""
    if column not in batch.columns:
        raise AlignConfigError(
            f"model.completion_column: the data rows have no {column!r} column to take the "
            f"reference completions from; their columns: {sorted(batch.columns)}"
        )
    tok = policy.tokenizer
    texts: Sequence = batch.columns[column]
    rows = []
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text.strip():
            raise AlignDataError(
                "the training data",
                None,
                column,
                f"a non-empty reference completion (model.completion_column) for the prompt {batch.prompts[i]!r}",
                text,
            )
        rows.append(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    truncated = torch.tensor([len(r) > max_new_tokens for r in rows])
    rows = [r[:max_new_tokens] for r in rows]
    device = next(policy.parameters()).device
    prompt_ids, prompt_mask = left_pad(batch.prompt_ids, tok.pad_token_id)
    width = max(len(r) for r in rows)
    response_ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        response_ids[i, : len(r)] = torch.tensor(r)
        response_mask[i, : len(r)] = True
    n = len(rows)
    return Rollout(
        prompt_ids.to(device),
        prompt_mask.to(device),
        response_ids.to(device),
        response_mask.to(device),
        torch.zeros(n, width, device=device),
        truncated.to(device),
        [str(t) for t in texts],
        torch.arange(n, device=device),
        1,
        0.0,
    )

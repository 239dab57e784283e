"""Losses: token aggregation under one step-wide normaliser, the value loss and SFT's next-token loss.

The policy losses (the ``POLICY_LOSSES`` table) are in :mod:`align.core.policy_losses`, the preference losses in
:mod:`align.core.preference_losses`.

Papers: clipped value loss from the OpenAI baselines PPO2 implementation, studied by Engstrom et al. 2020
(arXiv 2005.12729).

Normalisation (``aggregate``): every token loss is a *sum* over valid tokens divided by a normaliser. By default the
normaliser is computed from the tensors passed in; the training modules pass the count for the whole optimizer step
(all microbatches, all ranks) instead, so that summing microbatch losses gives exactly the full-batch loss and no
later division by the number of accumulation steps is needed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from align.core.logprobs import selective_log_softmax
from align.core.masks import fill_masked, masked_mean, masked_sum

__all__ = ["AGGREGATIONS", "Normaliser", "aggregate", "check_normaliser", "loss_count", "value_loss", "sft_loss"]

Normaliser = int | float | torch.Tensor | None


# ----------------------------------------------------------------------------
# aggregation
# ----------------------------------------------------------------------------


def check_normaliser(normaliser: Normaliser, fn: str) -> None:
    if isinstance(normaliser, (int, float)) and not normaliser > 0:
        raise ValueError(f"{fn}: normaliser must be > 0, got {normaliser}")


def _token_mean(per_token: torch.Tensor, mask: torch.Tensor | None, normaliser: Normaliser) -> torch.Tensor:
    total = masked_sum(per_token, mask)
    if normaliser is None:
        normaliser = max(per_token.numel(), 1) if mask is None else mask.bool().sum().clamp(min=1)
    return total / normaliser


def _seq_mean(per_token: torch.Tensor, mask: torch.Tensor | None, normaliser: Normaliser) -> torch.Tensor:
    per_seq = masked_mean(per_token, mask, dim=-1)  # (B,), 0 for a row with no valid token
    if normaliser is None:
        normaliser = max(per_seq.shape[0], 1)
    return per_seq.sum() / normaliser


def _constant(per_token: torch.Tensor, mask: torch.Tensor | None, normaliser: Normaliser) -> torch.Tensor:
    total = masked_sum(per_token, mask)
    if normaliser is None:
        normaliser = max(per_token.numel(), 1)
    return total / normaliser


AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor | None, Normaliser], torch.Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean": _seq_mean,
    "constant": _constant,
}


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor | None,
    mode: str = "token_mean",
    normaliser: Normaliser = None,
) -> torch.Tensor:
    """Reduce a ``(B, T)`` per-token loss to a scalar over valid tokens (``mask=None``: every token is valid).

    Modes (``normaliser`` default in brackets):

    * ``"token_mean"``: sum over valid tokens / normaliser [number of valid
      tokens here; 1 if there are none].
    * ``"seq_mean"``: sum over sequences of each sequence's mean over its valid
      tokens / normaliser [B]. A sequence with no valid token contributes 0
      but still counts in the default B.
    * ``"constant"``: sum over valid tokens / normaliser [B * T]; Dr. GRPO's
      constant normaliser (arXiv 2503.20783). Pass ``n_sequences *
      max_new_tokens`` for the whole step so that it does not depend on the
      padded width of a microbatch.

    ``normaliser`` (number or tensor) should be the count over the whole
    optimizer step (all microbatches and ranks) in the unit of the mode; then
    the sum of per-microbatch results equals the full-batch result. Masked
    positions of ``per_token`` never affect the result.
    """
    try:
        fn = AGGREGATIONS[mode]
    except KeyError:
        raise ValueError(f"aggregate: unknown mode {mode!r}; expected one of {sorted(AGGREGATIONS)}") from None
    if mask is not None and per_token.shape != mask.shape:
        raise ValueError(f"aggregate: per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} must match")
    check_normaliser(normaliser, "aggregate")
    return fn(per_token, mask, normaliser)


def loss_count(mask: torch.Tensor, aggregation: str = "token_mean", max_length: int | None = None) -> torch.Tensor:
    """This rank's count of loss terms under ``mask`` (N, R), in the unit of ``aggregation``: valid tokens
    (``token_mean``), rows (``seq_mean``), or rows x ``max_length`` (``constant``: Dr. GRPO's normaliser, arXiv
    2503.20783, which does not depend on how long the sampled responses happen to be). A float ``()`` tensor."""
    if aggregation == "token_mean":
        count = mask.sum()
    elif aggregation == "seq_mean":
        count = torch.tensor(mask.shape[0], device=mask.device)
    elif aggregation == "constant":
        if max_length is None:
            raise ValueError("loss_count: aggregation 'constant' needs max_length")
        count = torch.tensor(mask.shape[0] * max_length, device=mask.device)
    else:
        raise ValueError(f"loss_count: expected token_mean, seq_mean or constant, got {aggregation!r}")
    return count.float()


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor | None,
    clip: float | None = None,
    agg: str = "token_mean",
    normaliser: Normaliser = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared-error value loss, optionally clipped around the rollout values.

    ``0.5 * (V - R)**2``; with ``clip`` set,
    ``0.5 * max((V - R)**2, (V_clip - R)**2)`` where
    ``V_clip = old_values + clamp(V - old_values, -clip, clip)``.

    Args:
        values: ``(B, T)`` current value predictions (with grad).
        old_values: ``(B, T)`` values recorded at rollout time.
        returns: ``(B, T)`` targets from :func:`align.core.advantages.gae`.
        mask: ``(B, T)`` response mask; ``None``: every token is valid (one
            action per row in classic RL), the same result with fewer operations.

    Returns:
        ``(loss, clipfrac)``: scalar loss and the detached fraction of valid
        tokens where the clipped term was the larger one (0 without ``clip``).
    """
    valid = None if mask is None else mask.bool()
    values = fill_masked(values, valid)
    old_values = fill_masked(old_values.detach(), valid)
    returns = fill_masked(returns.detach(), valid)
    unclipped = (values - returns).square()
    if clip is None:
        per_token = 0.5 * unclipped
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        if clip <= 0:
            raise ValueError(f"value_loss: clip must be > 0 or None, got {clip}")
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (v_clipped - returns).square()
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        with torch.no_grad():
            clipfrac = masked_mean((clipped > unclipped).to(values.dtype), mask)
    return aggregate(per_token, mask, agg, normaliser), clipfrac


# ----------------------------------------------------------------------------
# SFT
# ----------------------------------------------------------------------------


def sft_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    normaliser: Normaliser = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Next-token negative log-likelihood, summed over label tokens / normaliser.

    Args:
        logits: ``(B, T, V)`` model outputs for ``input_ids``.
        labels: ``(B, T)`` aligned with ``input_ids`` (Hugging Face
            convention): ``logits[:, t]`` predicts ``labels[:, t + 1]``; the
            shift happens here. ``ignore_index`` marks tokens without loss.
        normaliser: defaults to the number of non-ignored (shifted) labels; pass
            the count for the whole optimizer step under accumulation or data
            parallelism.

    Returns:
        Scalar float32 loss; 0 with a gradient (not NaN) when no label is valid.

    float32 logits go through one fused ``F.cross_entropy(reduction="sum")``.
    bf16/fp16 logits go through :func:`align.core.logprobs.selective_log_softmax`,
    which upcasts one chunk at a time and keeps no float32 copy for backward.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"sft_loss: logits must be (B, T, V) and labels (B, T); got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    check_normaliser(normaliser, "sft_loss")
    # Shift the labels instead of slicing the logits, which would copy them.
    ignore = torch.full_like(labels[:, :1], ignore_index)
    targets = torch.cat([labels[:, 1:], ignore], dim=1)  # (B, T)
    valid = targets != ignore_index  # (B, T)
    vocab = logits.shape[-1]
    if logits.dtype in (torch.float32, torch.float64):
        total = F.cross_entropy(
            logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=ignore_index, reduction="sum"
        ).float()
    else:
        token_logps = selective_log_softmax(logits, torch.where(valid, targets, 0))  # (B, T)
        total = -masked_sum(token_logps, valid)
    if normaliser is None:
        normaliser = valid.sum().clamp(min=1)
    return total / normaliser

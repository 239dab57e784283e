"""The sampler/trainer mismatch: how far a generation engine's log-probs are from the trainer's, and the importance
weights that correct a policy-gradient update for it.

An engine other than align's own decoder (vLLM) samples with its own kernels, often in a lower precision, so the
probability it gave a sampled token (``engine_logprobs``, the behaviour policy ``mu``) differs from the one the
trainer computes for the same weights (``trainer_logprobs``, ``pi``). The update's importance ratio is taken against
``pi`` (the trainer's recomputed log-probs are the ``old_logprobs``), and each token's (or sequence's) loss is
weighted by ``w = f(pi / mu)``, detached, which makes the gradient that of data sampled from ``pi`` again:

* ``tis``, truncated importance sampling (Ionides 2008; as in Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"): ``w = min(pi / mu, cap)``; the cap bounds the variance, at a small bias.
* ``mis``, masked importance sampling: ``w = pi / mu`` where it lies in ``[low, high]`` and 0 outside, so tokens the
  engine and trainer disagree on badly are dropped from the update instead of weighted.

At ``level: token`` each token has its own weight; at ``level: sequence`` a row's ratio is the product of its tokens'
ratios (the sum of the log-ratios) and every token of the row takes the row's weight, as a sequence-level loss (GSPO,
GMPO) needs.

The diagnostics, over valid tokens: ``logprob_diff`` is ``mean |log pi - log mu|`` and ``kl`` the k3 estimate of
``KL(mu || pi)`` per token, ``(r - 1) - log r`` with ``r = pi / mu`` on tokens sampled from ``mu`` (non-negative,
unbiased; J. Schulman, "Approximating KL divergence").

Departure: log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp``, so one token that either
side found all but impossible cannot overflow a weight: at ``level: token`` each token's, at ``level: sequence`` the
row's sum (its tokens' log-ratios are summed unclamped, so two far-out tokens that cancel leave the row's ratio as it
is). The diagnostics read the clamped per-token log-ratios.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from align.core.masks import masked_mean

__all__ = [
    "CORRECTION_MODES",
    "CORRECTION_LEVELS",
    "LOG_RATIO_CLAMP",
    "MismatchStats",
    "correction_weights",
    "mismatch_stats",
]

CORRECTION_MODES = ("none", "tis", "mis")
"""``none``: weight 1 everywhere; ``tis``: truncated importance sampling; ``mis``: masked importance sampling."""
CORRECTION_LEVELS = ("token", "sequence")
LOG_RATIO_CLAMP = 20.0


class MismatchStats(NamedTuple):
    """Scalar diagnostics of one rollout: ``logprob_diff`` (mean ``|log pi - log mu|``), ``kl`` (k3 estimate of
    ``KL(mu || pi)`` per token), ``clipped_frac`` (share of weighted units whose ratio the cap lowered) and
    ``masked_frac`` (share dropped by ``mis``); units are tokens at ``level: token``, rows at ``level: sequence``."""

    logprob_diff: torch.Tensor
    kl: torch.Tensor
    clipped_frac: torch.Tensor
    masked_frac: torch.Tensor


def _log_ratio(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # log pi/mu on the tokens of mask, 0 elsewhere (replaced, so a NaN there reaches nothing); not clamped
    log_ratio = trainer_logprobs.float() - engine_logprobs.float()
    return torch.where(mask, log_ratio, torch.zeros_like(log_ratio))  # (N, R)


def correction_weights(
    trainer_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "tis",
    level: str = "token",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor, MismatchStats]:
    """``(weights (N, R), stats)``: the detached importance weights of the tokens ``mask`` (N, R) bool (0 elsewhere)
    for an update against ``trainer_logprobs`` of data sampled with ``engine_logprobs`` (both (N, R)), and the
    rollout's :class:`MismatchStats`."""
    if mode not in CORRECTION_MODES:
        raise ValueError(f"correction mode must be one of {CORRECTION_MODES}, got {mode!r}")
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"correction level must be one of {CORRECTION_LEVELS}, got {level!r}")
    mask = mask.bool()
    log_ratio = _log_ratio(trainer_logprobs, engine_logprobs, mask).detach()  # (N, R), not clamped
    if level == "sequence":
        units = mask.any(dim=1)  # (N,) rows with at least one token
        # the row's log-ratio summed over its tokens first, then clamped: +25 and -24 make e, not e^(20 - 20) = 1
        unit_ratio = log_ratio.sum(dim=1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # (N,)
        ratio = unit_ratio[:, None].expand_as(log_ratio)  # every token takes its row's ratio
    else:
        units, unit_ratio = mask, log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        ratio = unit_ratio
    if mode == "tis":
        weights = ratio.clamp(max=cap)
        clipped, dropped = unit_ratio > cap, torch.zeros_like(units)
    elif mode == "mis":
        keep = (ratio >= low) & (ratio <= high)
        weights = torch.where(keep, ratio, torch.zeros_like(ratio))
        clipped, dropped = torch.zeros_like(units), (unit_ratio < low) | (unit_ratio > high)
    else:
        weights = torch.ones_like(ratio)
        clipped = dropped = torch.zeros_like(units)
    weights = torch.where(mask, weights, torch.zeros_like(weights))
    count = units.sum().clamp(min=1).float()
    return weights, _stats(log_ratio, mask)._replace(
        clipped_frac=(clipped & units).sum() / count, masked_frac=(dropped & units).sum() / count
    )


def mismatch_stats(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> MismatchStats:
    """The rollout's mean absolute log-prob difference and k3 KL(engine || trainer) per valid token of ``mask``
    (``clipped_frac`` and ``masked_frac`` 0: no correction is applied here)."""
    mask = mask.bool()
    return _stats(_log_ratio(trainer_logprobs, engine_logprobs, mask).detach(), mask)


def _stats(log_ratio: torch.Tensor, mask: torch.Tensor) -> MismatchStats:
    """Diagnostics of the masked ``log pi/mu`` (N, R), each token's clamped first; the correction's shares left at 0."""
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = log_ratio.exp() - 1 - log_ratio  # (N, R) >= 0
    zero = torch.zeros((), device=log_ratio.device)
    return MismatchStats(masked_mean(log_ratio.abs(), mask), masked_mean(k3, mask), zero, zero)

"""Statistics over the valid elements of every data-parallel rank: mean and variance, whitening, explained
variance, and PPO's score options; and the unbiased pass@k of sampled evaluation (:func:`pass_at_k`).

Each function takes the cross-rank reduction as an argument, ``all_reduce``: a callable that sums a tensor
over the ranks and returns the sum (``LightningModule``-side: :meth:`align.modules.base.AlignModule.
all_reduce_sum`). The default, :func:`identity`, is the single-process case, so one process and several
ranks run the same code and a two-shard test can check that they agree. :class:`Ranks` carries it with this
process's rank and the number of ranks, for the sampler, the rollout sources and the learner.

Choices:

* Statistics are computed in float32 at least (float64 stays float64) and detached: they are constants of
  the rollout, never differentiated through. Only ``x`` itself carries a gradient through :func:`whiten`.
* The variance is unbiased (``n - 1``) and two-pass: one reduction of the sum and count, a second of the
  squared deviations from the global mean. The one-pass ``sum(x**2) - n * mean**2`` loses every digit when
  the mean is large against the spread (returns of a few hundred with a spread of 0.01).
* Nothing valid anywhere is not an error: the mean and variance are 0, whitening leaves the values alone.
  Whitening with fewer than 2 valid elements in all returns the valid values unchanged (docs/algorithms.md,
  "Whitening"); one process gives exactly :func:`align.core.masks.masked_whiten` on float32 input.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from align.core.masks import masked_sum

__all__ = [
    "AllReduce",
    "identity",
    "Ranks",
    "mean_var",
    "whiten",
    "explained_variance",
    "transform_scores",
    "pass_at_k",
]

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the data-parallel ranks and returns the sum (every rank gets the same value)."""


def identity(x: torch.Tensor) -> torch.Tensor:
    """The all-reduce of a single process."""
    return x


@dataclass(frozen=True)
class Ranks:
    """The data-parallel ranks a sampler, a rollout source or the learner works across: this process's ``rank`` of
    ``size``, and ``all_reduce`` (sums a tensor over every rank; the identity on one process)."""

    rank: int = 0
    size: int = 1
    all_reduce: AllReduce = identity


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32) if x.is_floating_point() else torch.float32


def _moments(
    x: torch.Tensor, valid: torch.Tensor, all_reduce: AllReduce
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # (mean, unbiased variance, count) of the valid elements of every rank, detached, in _stat_dtype.
    x = x.detach().to(_stat_dtype(x))
    total, n = all_reduce(torch.stack([masked_sum(x, valid), valid.sum().to(x.dtype)])).unbind()
    mean = total / n.clamp(min=1.0)
    squares = all_reduce(masked_sum((x - mean).square(), valid))
    return mean, squares / (n - 1).clamp(min=1.0), n


def mean_var(
    x: torch.Tensor,
    mask: torch.Tensor,
    all_reduce: AllReduce = identity,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance (scalars) of the valid elements of ``x`` on every rank.

    ``mask`` is broadcastable to ``x``. Two all-reduces: ``[sum, count]``, then the sum of squared
    deviations. The variance is 0 when fewer than 2 elements are valid in all, the mean 0 when none is.
    """
    mean, var, _ = _moments(x, mask.bool().expand_as(x), all_reduce)
    return mean, var


def whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-8,
    all_reduce: AllReduce = identity,
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with the mean and unbiased variance of the valid elements of every rank.

    PPO's advantage whitening. Masked outputs are exactly 0 and do not depend on masked inputs (a NaN there
    stays out). Fewer than 2 valid elements in all: the valid values unchanged. ``eps`` only guards the
    division: valid values that are all equal give 0 for any ``eps > 0``.
    """
    valid = mask.bool().expand_as(x)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    x = torch.where(valid, x, zero)
    mean, var, n = _moments(x, valid, all_reduce)
    whitened = (x - mean.to(x.dtype)) * torch.rsqrt(var + eps).to(x.dtype)
    return torch.where(valid, torch.where(n >= 2, whitened, x), zero)


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce = identity
) -> torch.Tensor:
    """``1 - Var(returns - values) / Var(returns)`` over the valid elements of every rank (a scalar).

    1 for a critic that predicts the returns exactly, 0 for one that predicts a constant, negative for one
    worse than a constant. 0 when ``Var(returns) = 0`` (nothing to explain, including nothing valid).
    """
    _, var_returns = mean_var(returns, mask, all_reduce)
    _, var_error = mean_var(returns - values, mask, all_reduce)
    return torch.where(var_returns > 0, 1 - var_error / var_returns.clamp(min=1e-12), torch.zeros_like(var_returns))


def transform_scores(
    scores: torch.Tensor,
    truncated: torch.Tensor,
    missing_eos_penalty: float | None = None,
    whiten_scores: bool = False,
    scale: float = 1.0,
    clip: float | None = None,
    all_reduce: AllReduce = identity,
    eps: float = 1e-8,
) -> torch.Tensor:
    """PPO's sequence-score options, in this order: EOS penalty, whitening, scaling, clipping. ``(N,) -> (N,)``.

    Args:
        scores: ``(N,)`` sequence rewards.
        truncated: ``(N,)`` bool, responses cut off at ``max_new_tokens`` without an EOS.
        missing_eos_penalty: Subtracted from the score of each truncated response; None: no penalty.
        whiten_scores: Whiten the scores with their mean and unbiased std over every rank.
        scale: Factor applied after whitening.
        clip: Clip to ``[-clip, clip]`` last; None: no clipping.
        all_reduce: Sum over the ranks, for the whitening statistics.
        eps: Added to the variance before the square root.
    """
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * truncated.to(scores.dtype)
    if whiten_scores:
        mean, var = mean_var(scores, torch.ones_like(scores, dtype=torch.bool), all_reduce)
        scores = (scores - mean) * torch.rsqrt(var + eps)
    scores = scores * scale
    if clip is not None:
        scores = scores.clamp(-clip, clip)
    return scores


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct: ``1 - C(n - c, k) / C(n, k)``.

    The probability that at least one of ``k`` samples drawn without replacement from the ``n`` is correct
    (Chen et al. 2021, arXiv 2107.03374, eq. 1). Computed with exact integers, so large ``n`` loses nothing.
    ``k = 1`` gives ``c / n``; ``k = n`` gives 1 when any sample is correct, else 0.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k must be in [1, n={n}], got {k}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c must be in [0, n={n}], got {c}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)

"""The response mask and statistics over the valid tokens of a batch.

Everything here is a pure function of tensors and imports only ``torch``. Every caller in ``align`` builds its
masks and masked statistics with these functions, so the epsilons and the padding rules live in one place.

Response mask (see ``docs/algorithms.md``): a response is valid up to *and
including* its first EOS token, and everything after that is padding. The mask
is built from the position of the first EOS, never as ``ids != pad_token_id``,
so it stays correct when the pad id equals the EOS id. A response cut off at
``max_new_tokens`` has no EOS; it is fully valid unless the caller asks for
``mask_truncated=True``. No EOS is ever appended.

Whitening follows the PPO implementation practice described in "The 37
implementation details of PPO" and "The N+ implementation details of RLHF with
PPO" (Huang et al. 2024, arXiv 2403.17031): subtract the mean and divide by the
standard deviation of the *valid* tokens only. Departures: outputs at masked
positions are always exactly 0, and with fewer than 2 valid tokens the input is
returned unwhitened (a standard deviation of one value is undefined).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "TokenIds",
    "response_mask",
    "truncated",
    "last_valid_index",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "fill_masked",
]

TokenIds = int | Sequence[int] | torch.Tensor


def _is_eos(response_ids: torch.Tensor, eos_token_id: TokenIds) -> torch.Tensor:
    if isinstance(eos_token_id, int):
        return response_ids == eos_token_id
    eos = torch.as_tensor(eos_token_id, dtype=response_ids.dtype, device=response_ids.device).reshape(-1)
    if eos.numel() == 0:
        raise ValueError("response_mask: eos_token_id is an empty sequence; give at least one stop token id")
    return torch.isin(response_ids, eos)


def response_mask(
    response_ids: torch.Tensor,
    eos_token_id: TokenIds,
    *,
    mask_truncated: bool = False,
) -> torch.Tensor:
    """Valid-token mask of generated responses.

    Args:
        response_ids: ``(B, T)`` generated token ids (the prompt excluded),
            right-padded.
        eos_token_id: one stop-token id, or several (any of them ends a
            response).
        mask_truncated: zero out responses that contain no stop token (cut
            off at ``max_new_tokens``). Off by default.

    Returns:
        ``(B, T)`` bool: True from the first token up to and including the
        first stop token, False after it. A response without a stop token is
        all True, unless ``mask_truncated`` is set, then all False.

    Position ``t`` is valid iff no stop token occurs strictly before ``t``. The
    padding value is never consulted, so ``pad_token_id == eos_token_id`` works.
    """
    if response_ids.dim() != 2:
        raise ValueError(f"response_mask: response_ids must be (B, T), got shape {tuple(response_ids.shape)}")
    is_eos = _is_eos(response_ids, eos_token_id)  # (B, T)
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # stop tokens strictly before t
    mask = eos_before == 0  # (B, T)
    if mask_truncated:
        mask = mask & is_eos.any(dim=1, keepdim=True)
    return mask


def truncated(response_ids: torch.Tensor, eos_token_id: TokenIds) -> torch.Tensor:
    """``(B,)`` bool: True for responses with no stop token (cut at max length)."""
    if response_ids.dim() != 2:
        raise ValueError(f"truncated: response_ids must be (B, T), got shape {tuple(response_ids.shape)}")
    return ~_is_eos(response_ids, eos_token_id).any(dim=1)


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` long: index of the last valid position of each ``(B, T)`` mask row.

    A row with no valid position gives ``-1``. Do not use the result as an
    index without checking for ``-1`` (it would silently address the last
    column); :func:`align.core.advantages.shape_rewards` gives such rows no reward.
    """
    if mask.dim() != 2:
        raise ValueError(f"last_valid_index: mask must be (B, T), got shape {tuple(mask.shape)}")
    b, t = mask.shape
    if t == 0:
        return torch.full((b,), -1, dtype=torch.long, device=mask.device)
    positions = torch.arange(t, device=mask.device).expand(b, t)  # (B, T)
    return torch.where(mask.bool(), positions, -1).amax(dim=1)


# ----------------------------------------------------------------------------
# masked statistics
# ----------------------------------------------------------------------------


def _valid(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Broadcast the mask to x's shape as bool; the result selects valid elements.
    return mask.bool().expand_as(x) if mask.shape != x.shape else mask.bool()


def masked_sum(x: torch.Tensor, mask: torch.Tensor | None, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over valid elements (``mask`` broadcastable to ``x``; ``None``: every element is valid).

    Masked elements are replaced by 0 rather than multiplied by 0, so a NaN or
    inf in padding cannot leak into the result or its gradient.
    """
    if mask is None:
        return x.sum() if dim is None else x.sum(dim)
    valid = _valid(x, mask)
    zeroed = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return zeroed.sum() if dim is None else zeroed.sum(dim)


def _count(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    valid = _valid(x, mask)
    n = valid.sum() if dim is None else valid.sum(dim)
    return n.to(x.dtype if x.is_floating_point() else torch.float32)


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over valid elements (``mask=None``: all of them); 0 (never NaN) where nothing is valid."""
    if mask is None:
        n = x.numel() if dim is None else x.shape[dim]
        return masked_sum(x, None, dim) / max(n, 1)
    return masked_sum(x, mask, dim) / _count(x, mask, dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor | None, unbiased: bool = True) -> torch.Tensor:
    """Variance (scalar) of ``x`` over all valid elements (``mask=None``: all of them).

    ``unbiased=True`` divides by ``n - 1`` (Bessel). Returns 0 when there are
    too few valid elements (n < 2 unbiased, n < 1 biased) instead of NaN.
    """
    if mask is None:
        if x.numel() < (2 if unbiased else 1):
            return torch.zeros((), dtype=x.dtype, device=x.device)
        return torch.var(x, correction=1 if unbiased else 0)
    valid = _valid(x, mask)
    n = _count(x, mask)
    mean = masked_sum(x, valid) / n.clamp(min=1)
    centered = torch.where(valid, x - mean, torch.zeros((), dtype=x.dtype, device=x.device))
    denom = (n - 1) if unbiased else n
    return (centered**2).sum() / denom.clamp(min=1)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Whiten ``x`` with the mean and unbiased std of its valid elements.

    ``(x - mean) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is
    added back (only the scale changes). Masked outputs are exactly 0 and do
    not depend on masked inputs. With fewer than 2 valid elements the valid
    values are returned unchanged (masked ones still 0). No host sync: the
    "fewer than 2" rule is applied with ``torch.where``. ``mask=None``: every
    element is valid (the same result, with a few plain reductions).
    """
    if mask is None:
        if x.numel() < 2:
            return x
        mean = x.mean()
        whitened = (x - mean) * torch.rsqrt(masked_var(x, None) + eps)
        return whitened if shift_mean else whitened + mean
    valid = _valid(x, mask)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    # Replace padding first: a NaN there must not reach the gradient through the
    # product with rsqrt(var).
    x = torch.where(valid, x, zero)
    n = _count(x, mask)
    mean = masked_sum(x, valid) / n.clamp(min=1)
    var = masked_var(x, valid, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    out = torch.where(n >= 2, whitened, x)
    return torch.where(valid, out, zero)


def fill_masked(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``x`` with its invalid elements (``valid`` False) replaced by 0, not multiplied away: a NaN there reaches
    neither a loss nor any gradient. ``valid=None``: every element is valid."""
    if valid is None:  # every element is valid
        return x
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))

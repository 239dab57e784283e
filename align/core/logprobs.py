"""Token log-probabilities and entropy from logits, chunked so that a full-vocabulary float32 copy never exists (the
output head fused with them, so that the logits never exist at all: :mod:`align.core.linear_head`).

Shapes: ``B`` is the batch, ``T`` the response length, ``V`` the vocabulary. The response mask and the masked
statistics are in :mod:`align.core.masks`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["check_temperature", "compute_dtype", "entropy_from_logits", "rows_per_chunk", "selective_log_softmax"]

# Rows of a (N, V) logits matrix processed at once by the chunked kernels: about
# 2**24 float32 elements (64 MiB) per chunk whatever the vocabulary size.
_CHUNK_ELEMENTS = 1 << 24


def rows_per_chunk(vocab_size: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, vocab_size))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float64 stays float64 (useful for gradient checks); everything else is float32.
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------
# log-probabilities and entropy
# ----------------------------------------------------------------------------


class _LowPrecisionSelectiveLogSoftmax(torch.autograd.Function):
    """log p(index) under softmax(logits / T) for bf16/fp16 logits without keeping a float32 copy.

    Autograd through ``log_softmax(logits.float() / T)`` would save a float32
    (N, V) tensor for the backward pass, twice the size of the bf16 logits.
    Here the forward keeps only the logits (which the graph holds anyway) and
    a float32 log-normaliser per row; the backward recomputes the softmax one
    chunk of rows at a time: d log p(i) / d logits = (onehot(i) - softmax) / T.
    The temperature divides each chunk after its upcast, as the sampler does,
    never the low-precision logits (whose rounding would shift every log-prob).
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, index: torch.Tensor, temperature: float) -> torch.Tensor:
        # logits (N, V) low precision, index (N,) long
        n, vocab = logits.shape
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)  # (N,)
        step = rows_per_chunk(vocab)
        for start in range(0, n, step):
            lse[start : start + step] = torch.logsumexp(logits[start : start + step].float() / temperature, dim=-1)
        picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1).float() / temperature  # (N,)
        ctx.temperature = temperature
        ctx.save_for_backward(logits, index, lse)
        return picked - lse

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # grad_out (N,)
        logits, index, lse = ctx.saved_tensors
        t = ctx.temperature
        n, vocab = logits.shape
        grad_logits = torch.empty_like(logits)
        step = rows_per_chunk(vocab)
        for start in range(0, n, step):
            rows = slice(start, start + step)
            g = grad_out[rows].float().unsqueeze(-1) / t  # (n_chunk, 1)
            probs = torch.exp(logits[rows].float() / t - lse[rows].unsqueeze(-1))  # (n_chunk, V)
            chunk = -probs * g
            chunk.scatter_add_(-1, index[rows].unsqueeze(-1), g)
            grad_logits[rows] = chunk.to(logits.dtype)
        return grad_logits, None, None


def check_temperature(fn: str, temperature: float) -> float:
    if not temperature > 0:
        raise ValueError(f"{fn}: temperature must be > 0, got {temperature}")
    return float(temperature)


_SMALL_LOGITS = 1 << 16
"""Float32/64 logits of at most this many elements (a classic-RL policy's few actions, never a vocabulary) take the
plain paths of :func:`selective_log_softmax` and :func:`entropy_from_logits`: their saved tensors are as small as
the logits, and one fused kernel costs less than the chunked or ``logsumexp`` form."""


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of the token ``index`` under ``softmax(logits / temperature)``.

    Args:
        logits: ``(..., V)`` in any floating dtype.
        index: ``(...)`` integer token ids.
        temperature: ``> 0``; applied after the upcast to float32, exactly as the sampler in
            :mod:`align.rollout.engine` applies it, so that sampled and trained log-probs agree in bf16 too.

    Returns:
        ``(...)`` log-probabilities in float32 (float64 if the logits are
        float64). Gradients flow to ``logits``.

    Equals ``log_softmax(logits.float() / temperature, -1).gather(-1, index)``
    without materialising the full-vocabulary log-softmax: float32/float64
    logits use ``gather - logsumexp``; bf16/fp16 logits are upcast one chunk
    of rows at a time, and the backward recomputes the softmax in chunks
    instead of keeping a float32 copy of the logits alive.
    """
    if logits.shape[:-1] != index.shape:
        raise ValueError(
            f"selective_log_softmax: index shape {tuple(index.shape)} must equal "
            f"logits shape without the vocabulary dim {tuple(logits.shape[:-1])}"
        )
    temperature = check_temperature("selective_log_softmax", temperature)
    index = index.long()
    if logits.dtype in (torch.float32, torch.float64):
        if temperature != 1.0:
            logits = logits / temperature
        if logits.numel() <= _SMALL_LOGITS:  # a few actions (classic RL): one fused kernel, faster than logsumexp
            return F.log_softmax(logits, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
        picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)  # (...)
        return picked - torch.logsumexp(logits, dim=-1)
    vocab = logits.shape[-1]
    flat: torch.Tensor = _LowPrecisionSelectiveLogSoftmax.apply(
        logits.reshape(-1, vocab), index.reshape(-1), temperature
    )
    return flat.view(index.shape)


class _ChunkedEntropy(torch.autograd.Function):
    """Entropy of softmax(logits / T) per row, chunked in forward and backward.

    With x = logits / T (upcast first): H = logsumexp(x) - sum(p * x) and
    dH/dlogits = -p * (log p + H) / T; the backward recomputes p per chunk so
    no (N, V) float32 tensor is saved.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, chunk_size: int, temperature: float) -> torch.Tensor:  # logits (N, V)
        dtype = compute_dtype(logits.dtype)
        n = logits.shape[0]
        out = torch.empty(n, dtype=dtype, device=logits.device)  # (N,)
        for start in range(0, n, chunk_size):
            x = logits[start : start + chunk_size].to(dtype) / temperature
            logp = F.log_softmax(x, dim=-1)
            out[start : start + chunk_size] = -(logp.exp() * logp).sum(-1)
        ctx.chunk_size = chunk_size
        ctx.temperature = temperature
        ctx.save_for_backward(logits, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # grad_out (N,)
        logits, entropy = ctx.saved_tensors
        dtype, t = entropy.dtype, ctx.temperature
        grad_logits = torch.empty_like(logits)
        step = ctx.chunk_size
        for start in range(0, logits.shape[0], step):
            rows = slice(start, start + step)
            logp = F.log_softmax(logits[rows].to(dtype) / t, dim=-1)  # (n_chunk, V)
            g = grad_out[rows].to(dtype).unsqueeze(-1) / t
            grad = -logp.exp() * (logp + entropy[rows].unsqueeze(-1)) * g
            grad_logits[rows] = grad.to(logits.dtype)
        return grad_logits, None, None


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1024, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the categorical distribution ``softmax(logits / temperature)``.

    Args:
        logits: ``(..., V)``.
        chunk_size: rows (tokens) upcast to float32 at once; bounds the peak
            memory of both the forward and the backward pass.
        temperature: ``> 0``; divides each chunk after its upcast (see
            :func:`selective_log_softmax`).

    Returns:
        ``(...)`` entropies in float32 (float64 for float64 logits), always
        >= 0 up to rounding. Differentiable.

    Padding is not excluded here; average with :func:`masked_mean` and the
    response mask so that padding never enters an entropy metric.
    """
    if chunk_size < 1:
        raise ValueError(f"entropy_from_logits: chunk_size must be >= 1, got {chunk_size}")
    temperature = check_temperature("entropy_from_logits", temperature)
    if logits.numel() <= _SMALL_LOGITS and logits.dtype in (torch.float32, torch.float64):
        # A few actions' logits (classic RL): plain autograd, whose saved tensors are as small as the logits.
        logp = F.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
        return -(logp.exp() * logp).sum(-1)
    vocab = logits.shape[-1]
    flat: torch.Tensor = _ChunkedEntropy.apply(logits.reshape(-1, vocab), int(chunk_size), temperature)
    return flat.view(logits.shape[:-1])

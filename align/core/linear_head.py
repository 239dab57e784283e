"""The output head and the log-softmax in one chunked pass: token log-probabilities (and entropies) of hidden states
under ``softmax((hidden @ W.T + b) / T)``, without the ``(N, V)`` logits ever existing at once (forward or backward),
and twice differentiable (TRPO's Fisher-vector products). The scorer uses it for plain linear heads
(:mod:`align.models.scoring`); :mod:`align.core.logprobs` holds the kernels over given logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from align.core.logprobs import check_temperature, compute_dtype, rows_per_chunk

__all__ = ["linear_log_softmax"]


def _linear_log_softmax_grads(
    hidden: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    bias: torch.Tensor | None,  # (V,)
    index: torch.Tensor,  # (N,)
    grad_logprobs: torch.Tensor,  # (N,)
    grad_entropy: torch.Tensor | None,  # (N,)
    temperature: float,
    chunk_rows: int,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The backward of :class:`_LinearLogSoftmax` out of place, with the log-normaliser recomputed from the
    logits, so that autograd can differentiate it again (double backpropagation, as TRPO's Fisher-vector products
    do): every quantity is a differentiable function of ``hidden``, ``weight`` and ``bias``."""
    need_hidden, need_weight, need_bias = needs
    dtype = compute_dtype(weight.dtype)
    hidden_chunks: list[torch.Tensor] = []
    grad_weight: torch.Tensor | None = None
    grad_bias: torch.Tensor | None = None
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        h = hidden[rows]
        x = _scaled_logits(h, weight, bias, dtype, temperature)
        logp = torch.log_softmax(x, dim=-1)
        p = logp.exp()
        g = grad_logprobs[rows].to(dtype).unsqueeze(-1)
        onehot = torch.zeros_like(x).scatter(-1, index[rows].unsqueeze(-1), 1.0)
        grad_x = (onehot - p) * g
        if grad_entropy is not None:
            entropy = -(p * logp).sum(-1, keepdim=True)
            grad_x = grad_x - p * (logp + entropy) * grad_entropy[rows].to(dtype).unsqueeze(-1)
        grad_logits = (grad_x / temperature).to(weight.dtype)
        if need_hidden:
            hidden_chunks.append(grad_logits @ weight)
        if need_weight:
            part = grad_logits.t() @ h.to(weight.dtype)
            grad_weight = part if grad_weight is None else grad_weight + part
        if need_bias:
            part = grad_logits.sum(0)
            grad_bias = part if grad_bias is None else grad_bias + part
    grad_hidden = torch.cat(hidden_chunks) if need_hidden else None
    return grad_hidden, grad_weight, grad_bias


def _scaled_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, temperature: float
) -> torch.Tensor:  # (n_chunk, V)
    """A chunk's logits in the compute dtype, divided by the temperature (in place: the buffer is new)."""
    x = F.linear(hidden, weight, bias)
    x = x.to(dtype) if x.dtype != dtype else x
    return x.div_(temperature) if temperature != 1.0 else x


class _LinearLogSoftmax(torch.autograd.Function):
    """log p(index) (and optionally the entropy) under softmax((hidden @ W.T + b) / T), chunked over rows.

    Forward and backward each visit the rows in chunks, and each chunk's logits exist only while it is being
    processed: the saved state is ``hidden``, the head's weight and bias, and two float32 numbers per row (the
    log-normaliser and the entropy). The backward recomputes a chunk's logits (one more matmul of the head per
    chunk) and turns them into the gradients of the hidden states, the weight and the bias. When every row fits
    in one chunk, the forward keeps that chunk's log-probabilities for the backward instead (at most one chunk's
    memory, which the forward held anyway), so the head costs three matmuls instead of four:

    with x = logits / T, p = softmax(x) and log p(i) = x_i - lse,
      d log p(i) / dx = onehot(i) - p,       d H / dx = -p * (log p + H),
    and every logit gradient is divided by T once more for the temperature.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # (N, H)
        weight: torch.Tensor,  # (V, H)
        bias: torch.Tensor | None,  # (V,)
        index: torch.Tensor,  # (N,)
        temperature: float,
        chunk_rows: int,
        want_entropy: bool,
        backward_follows: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        dtype = compute_dtype(weight.dtype)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)  # (N,)
        picked = torch.empty(n, dtype=dtype, device=hidden.device)  # (N,)
        entropy = torch.empty(n, dtype=dtype, device=hidden.device) if want_entropy else None  # (N,)
        # One chunk and a backward to come: keep its log-probabilities rather than recompute its logits there.
        keep = n <= chunk_rows and backward_follows
        kept = lse.new_empty(0)
        for start in range(0, n, chunk_rows):
            rows = slice(start, start + chunk_rows)
            x = _scaled_logits(hidden[rows], weight, bias, dtype, temperature)  # (n_chunk, V)
            picked[rows] = x.gather(-1, index[rows].unsqueeze(-1)).squeeze(-1)
            # logsumexp in place on the chunk's buffer: x - max, then its exp (x itself is kept for the entropy
            # and for the backward).
            top = x.amax(dim=-1, keepdim=True)  # (n_chunk, 1)
            shifted = x.sub(top) if want_entropy or keep else x.sub_(top)
            p = shifted.exp_()
            total = p.sum(-1)
            lse[rows] = total.log() + top.squeeze(-1)
            if entropy is not None:  # H = lse - sum(p * x) with p = exp(x - lse)
                entropy[rows] = lse[rows] - p.mul_(x).sum(-1) / total
            if keep:
                del p, shifted
                kept = x.sub_(lse[rows].unsqueeze(-1))  # log p
        ctx.temperature, ctx.chunk_rows, ctx.has_bias = temperature, chunk_rows, bias is not None
        ctx.save_for_backward(
            hidden,
            weight,
            bias if bias is not None else hidden.new_empty(0),
            index,
            lse,
            entropy if entropy is not None else lse.new_empty(0),
            kept,
        )
        logprobs = picked - lse
        if entropy is not None:
            return logprobs, entropy
        return logprobs, lse.new_zeros(0)

    @staticmethod
    def backward(
        ctx: Any,
        grad_logprobs: torch.Tensor,
        grad_entropy: torch.Tensor,  # (N,), (N,) or empty
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None, None, None, None]:
        hidden, weight, bias, index, lse, entropy, kept = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        t, step = ctx.temperature, ctx.chunk_rows
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        # Autograd materialises an unused output's gradient as zeros; an entropy that was not asked for is empty.
        use_entropy = grad_entropy.numel() > 0 and entropy.numel() > 0
        if torch.is_grad_enabled():  # create_graph=True (Fisher-vector products): a backward autograd can differentiate
            grads = _linear_log_softmax_grads(
                hidden,
                weight,
                bias,
                index,
                grad_logprobs,
                grad_entropy if use_entropy else None,
                t,
                step,
                (need_hidden, need_weight, need_bias),
            )
            return (*grads, None, None, None, None, None)
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=lse.dtype) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=lse.dtype, device=weight.device) if need_bias else None
        for start in range(0, hidden.shape[0], step):
            rows = slice(start, start + step)
            h = hidden[rows]
            # In place on the chunk's one (n_chunk, V) buffer: x -> log p -> p -> the logit gradient. A kept chunk
            # is copied, so that a second backward (retain_graph) finds it as it was.
            logp = (
                kept.clone()
                if kept.numel()
                else _scaled_logits(h, weight, bias, lse.dtype, t).sub_(lse[rows].unsqueeze(-1))
            )
            g = grad_logprobs[rows].to(lse.dtype).unsqueeze(-1)  # (n_chunk, 1)
            if use_entropy:
                g_ent = grad_entropy[rows].to(lse.dtype).unsqueeze(-1)
                # -p * (g + (log p + H) * g_ent), with log p turned into p in place
                coef = logp.add(entropy[rows].unsqueeze(-1)).mul_(g_ent).add_(g)
                grad_x = logp.exp_().mul_(coef).neg_()
                del coef
            else:
                grad_x = logp.exp_().mul_(-g)
            grad_x.scatter_add_(-1, index[rows].unsqueeze(-1), g)
            if t != 1.0:
                grad_x.div_(t)
            grad_logits = grad_x.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t().to(grad_weight.dtype), h.to(grad_weight.dtype))
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0).to(grad_bias.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(weight.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def linear_log_softmax(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    index: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probabilities (and entropies) through an output head, without the full logits.

    Args:
        hidden: ``(..., H)`` final hidden states.
        weight: ``(V, H)`` output-head weight; ``bias``: ``(V,)`` or ``None``.
        index: ``(...)`` token ids whose log-probability is wanted.
        temperature: ``> 0``; divides the logits after their upcast to float32, as in
            :func:`selective_log_softmax`.
        return_entropy: also return the entropy of each row's distribution.
        chunk_rows: rows whose logits exist at once; by default about 2**24 logits (64 MiB in float32).

    Returns:
        ``(logprobs, entropy)``: ``(...)`` float32 (float64 for a float64 head) each; ``entropy`` is ``None``
        unless asked for. Gradients reach ``hidden``, ``weight`` and ``bias``.

    Equals ``selective_log_softmax(hidden @ weight.T + bias, index, temperature)`` and
    ``entropy_from_logits(...)`` of the same logits to float rounding, forward and backward, while the peak
    memory of the head is one chunk of logits instead of ``(..., V)`` logits plus their gradient. The price is
    one more matmul of the head in the backward pass (the chunk's logits are recomputed there), except when the
    rows fit in one chunk: then that chunk's log-probabilities are kept for the backward.
    """
    if hidden.shape[:-1] != index.shape:
        raise ValueError(
            f"linear_log_softmax: index shape {tuple(index.shape)} must equal hidden shape without the "
            f"hidden dim {tuple(hidden.shape[:-1])}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"linear_log_softmax: weight must be (V, {hidden.shape[-1]}), got {tuple(weight.shape)}")
    temperature = check_temperature("linear_log_softmax", temperature)
    if chunk_rows is None:
        chunk_rows = rows_per_chunk(weight.shape[0])
    if chunk_rows < 1:
        raise ValueError(f"linear_log_softmax: chunk_rows must be >= 1, got {chunk_rows}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    if flat_hidden.dtype != weight.dtype:
        flat_hidden = flat_hidden.to(weight.dtype)
    # (Inside the function's forward, grad mode is always off and an input's requires_grad does not say whether
    # a graph is being recorded.)
    backward_follows = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (flat_hidden, weight, bias)
    )
    flat_logprobs: torch.Tensor
    entropy: torch.Tensor
    flat_logprobs, entropy = _LinearLogSoftmax.apply(
        flat_hidden,
        weight,
        bias,
        index.reshape(-1).long(),
        temperature,
        int(chunk_rows),
        bool(return_entropy),
        backward_follows,
    )
    logprobs = flat_logprobs.view(index.shape)
    return logprobs, (entropy.view(index.shape) if return_entropy else None)

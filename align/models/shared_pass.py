"""A scoring pass in which tokens that several rows share run once.

The rows of a scoring pass (the RL update's log-probs and values, the reference's, a preference pair's) often begin
alike: a DPO pair or a GRPO group repeats one prompt, and a chat template puts the same system prompt in front of
every prompt. :func:`scoring_hidden` runs such tokens once, with gradients (autograd sums what reaches them from each
row), and gives every row the final hidden states that one pass over the whole rows gives, to float rounding. It
takes the cheapest of:

* **one call over laid-out rows** (:func:`align.core.packing.share_prompts`): ``[shared | rest of row 1 | rest of row 2
  | ...]``, each rest masked from the others by a custom 4D mask (``sdpa`` or ``eager`` attention, no sliding window).
  A laid-out row holds a piece of at most ``k`` rows, ``k`` chosen by :func:`best_piece_size`'s count of
  multiply-adds: fewer tokens through the linear layers against a longer row's attention;
* **two calls**: the shared tokens once, then every row's continuation reading their keys and values from the cache.
  Used where the layout does not apply or does not pay, when the tokens saved outweigh the second call
  (``_MIN_SHARED_PREFIX_WORK``) and layers are not recomputed (gradient checkpointing drops the cache). It saves less
  than the layout: each weight's gradient is computed once per call and the two are summed;
* **one pass over the rows**.

What is shared: the whole prompt (the first ``T - R`` columns) of rows whose prompts are equal; otherwise the first
tokens that every row's prompt starts with (:func:`align.core.packing.common_prefix`).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from align.core.packing import common_prefix, group_representatives, share_prompts, split_groups

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Shared tokens x decoder parameters below which a scoring pass does not split into a pass over the shared tokens
# and a continuation pass: about 1 GFLOP of forward work, more than the second call's fixed cost (a few ms on a
# CPU). The embedded tiny model (0.85M parameters) never reaches it; SmolLM2-135M does with 8 shared tokens.
_MIN_SHARED_PREFIX_WORK = 5 * 10**8
# The share of a pass's FLOPs a layout must save: it pays for building the mask and gathering the rows, and for
# attention under a custom mask, which runs no causal fast path.
_MIN_LAYOUT_SAVING = 0.1


@dataclass(frozen=True)
class DecoderFacts:
    """What :func:`scoring_hidden` reads from a decoder, once per decoder."""

    parameters: int
    cache_kwarg: str  # transformers 5.24 renamed ``past_key_values`` to ``cache``
    token_flops: int  # multiply-adds x 2 per token in the linear layers (the parameters less the embeddings)
    pair_flops: int  # the same per attended (query, key) pair: scores and weighted values over every layer


_FACTS: weakref.WeakKeyDictionary[nn.Module, DecoderFacts] = weakref.WeakKeyDictionary()


def decoder_facts(decoder: nn.Module) -> DecoderFacts:
    if decoder not in _FACTS:
        config = getattr(decoder, "config", None)  # without one (not a transformers model) no layout applies
        kwarg = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
        parameters = sum(p.numel() for p in decoder.parameters())
        embeddings = _input_embeddings(decoder).weight.numel()
        heads = getattr(config, "num_attention_heads", 1) or 1
        width = heads * (getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads)
        _FACTS[decoder] = DecoderFacts(
            parameters, kwarg, 2 * (parameters - embeddings), 4 * width * (getattr(config, "num_hidden_layers", 0) or 0)
        )
    return _FACTS[decoder]


def _input_embeddings(decoder: nn.Module) -> nn.Embedding:
    """The input embedding of a transformers decoder (transformers types it as any ``nn.Module``)."""
    return cast(nn.Embedding, cast("PreTrainedModel", decoder).get_input_embeddings())


def layout_mask_kind(decoder: nn.Module) -> str | None:
    """How ``decoder``'s attention takes a custom ``(B, 1, L, L)`` mask: ``"bool"`` (sdpa), ``"additive"`` (eager),
    or None (another implementation, or sliding-window attention, which such a mask would replace)."""
    config = getattr(decoder, "config", None)
    if config is None or (
        getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    ):
        return None
    kinds: dict[str | None, str] = {"sdpa": "bool", "eager": "additive"}
    return kinds.get(getattr(config, "_attn_implementation", None))


def pass_cost(rows: int, columns: int, token_flops: int, pair_flops: int) -> int:
    """FLOPs of a causal pass over ``rows`` rows of ``columns`` columns: the linear layers per token, and attention
    over every (query, key) pair of a row (a custom mask is dense: masked pairs cost as much)."""
    return rows * columns * (token_flops + pair_flops * columns)


def best_piece_size(group_sizes: list[int], shared: int, fed: int, token_flops: int, pair_flops: int) -> int:
    """The number of rows ``k`` per laid-out row that makes :func:`share_prompts`'s layout cheapest, for groups of
    ``group_sizes`` rows that share ``shared`` columns and feed ``fed`` columns each after them. Each group becomes
    ``ceil(n / k)`` rows of ``shared + k * fed`` columns. 1 (lay nothing out) unless that saves at least
    ``_MIN_LAYOUT_SAVING`` of one row per row's FLOPs."""

    def cost(k: int) -> int:
        rows = sum(-(-n // k) for n in group_sizes)
        return pass_cost(rows, shared + min(k, max(group_sizes)) * fed, token_flops, pair_flops)

    k = min(range(1, max(group_sizes) + 1), key=lambda k: (cost(k), k))
    return k if cost(k) <= (1 - _MIN_LAYOUT_SAVING) * cost(1) else 1


def scoring_hidden(
    decoder: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    R: int,
) -> torch.Tensor:
    """``(B, R, H)`` final hidden states of the positions ``T-R-1 .. T-2``, which predict the last ``R`` tokens of
    ``input_ids`` ``(B, T)``; tokens that rows share run once (see the module docstring)."""
    B, T = input_ids.shape
    P = T - R
    if R < 2 or B < 2 or P < 1:
        return plain_hidden(decoder, input_ids, attention_mask, position_ids, R)
    key = input_ids[:, :P]  # (B, P); padding marked apart, so a pad id equal to a real token cannot match
    if attention_mask is not None:
        key = torch.where(attention_mask[:, :P].bool(), key, -1)
    unique, group = torch.unique(key, dim=0, return_inverse=True)
    groups = unique.shape[0]
    rows = input_ids, attention_mask, position_ids
    if groups == B:  # no two prompts equal: the tokens they all start with, moved to the front of each row
        shared, order = common_prefix(input_ids, attention_mask, position_ids, P)
        if shared == 0:
            return plain_hidden(decoder, input_ids, attention_mask, position_ids, R)
        if order is not None:
            rows = (
                input_ids.gather(1, order),
                None if attention_mask is None else attention_mask.gather(1, order),
                None if position_ids is None else position_ids.gather(1, order),
            )
        group, groups = torch.zeros_like(group), 1
    else:
        shared = P
    facts = decoder_facts(decoder)
    mask_kind = layout_mask_kind(decoder)
    if mask_kind is not None:
        sizes = torch.bincount(group, minlength=groups).tolist()
        k = best_piece_size(sizes, shared, T - 1 - shared, facts.token_flops, facts.pair_flops)
        if k > 1:
            piece, pieces = split_groups(group, groups, k)
            return _laid_out_hidden(decoder, mask_kind, *rows, T - shared, piece, pieces)[:, -R:]
    recomputed = getattr(decoder, "gradient_checkpointing", False) and decoder.training
    if recomputed or (B - groups) * shared * facts.parameters < _MIN_SHARED_PREFIX_WORK:
        return plain_hidden(decoder, input_ids, attention_mask, position_ids, R)
    return _cached_prefix_hidden(decoder, facts.cache_kwarg, *rows, shared, group, groups)[:, -R:]


def plain_hidden(
    decoder: nn.Module,
    input_ids: torch.Tensor,  # (B, T)
    attention_mask: torch.Tensor | None,  # (B, T)
    position_ids: torch.Tensor | None,  # (B, T)
    R: int,
) -> torch.Tensor:
    T = input_ids.shape[1]
    hidden: torch.Tensor = decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state[:, T - R - 1 : T - 1]  # (B, R, H)
    return hidden


def _laid_out_hidden(
    decoder: nn.Module,
    mask_kind: str,
    input_ids: torch.Tensor,  # (B, T)
    attention_mask: torch.Tensor | None,  # (B, T)
    position_ids: torch.Tensor | None,  # (B, T)
    fed: int,
    piece: torch.Tensor,
    pieces: int,
) -> torch.Tensor:
    """``(B, fed, H)``: hidden states of the positions that predict each row's last ``fed`` tokens, from one call
    over ``pieces`` laid-out rows that each run their rows' first ``T - fed`` (equal) columns once."""
    rows = share_prompts(input_ids, attention_mask, position_ids, fed, piece, pieces)
    mask = rows.attention_mask
    if mask_kind == "additive":
        dtype = _input_embeddings(decoder).weight.dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    hidden = decoder(
        input_ids=rows.input_ids, attention_mask=mask, position_ids=rows.position_ids, use_cache=False
    ).last_hidden_state  # (pieces, L, H)
    return rows_of(hidden, rows.group[:, None] * hidden.shape[1] + rows.index)


def rows_of(hidden: torch.Tensor, flat_index: torch.Tensor) -> torch.Tensor:
    """``(*I, H)``: ``hidden`` ``(N, L, H)`` at the positions ``flat_index`` ``(*I)`` of its flattened ``(N * L)``
    positions, which repeat where rows share a position; its gradient sums the repeats in the same order every time.

    The gradient of indexing (``hidden[n, l]``) sums repeated positions with ``index_put_(accumulate=True)``. On a
    CPU, in float32 and past 32768 elements, that kernel adds from every thread with atomics, in an order that changes
    from call to call: two runs at one seed drifted apart in the 7th digit at 2 threads. :class:`_RowsOf` runs the
    same kernel in torch's deterministic mode, which on a CPU is its serial loop (as fast here; ``index_select``'s
    own gradient, also deterministic, took 2 to 3 times as long). On CUDA the kernel sorts the indices and is
    deterministic as it is."""
    H = hidden.shape[-1]
    flat = hidden.reshape(-1, H)
    if hidden.device.type != "cpu":
        return flat[flat_index]
    rows: torch.Tensor = _RowsOf.apply(flat, flat_index.reshape(-1))  # (K, H)
    return rows.reshape(*flat_index.shape, H)


class _RowsOf(torch.autograd.Function):
    """``flat[index]`` for ``flat`` ``(M, H)`` and ``index`` ``(K,)``, with a gradient summed in index order."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.shape = flat.shape
        return flat.index_select(0, index)  # (K, H)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.shape)
        with deterministic_algorithms():
            out.index_put_((index,), grad, accumulate=True)
        return out, None


@contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """torch's deterministic mode for the ops inside, then the mode as it was."""
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _cached_prefix_hidden(
    decoder: nn.Module,
    cache_kwarg: str,
    input_ids: torch.Tensor,  # (B, T)
    attention_mask: torch.Tensor | None,  # (B, T)
    position_ids: torch.Tensor | None,  # (B, T)
    C: int,
    group: torch.Tensor,
    groups: int,
) -> torch.Tensor:
    """``(B, T - C, H)``: hidden states of the positions ``C-1 .. T-2``, the first ``C`` columns (equal within each
    group of ``group``) run once per group, their keys and values read by every row's continuation."""
    T = input_ids.shape[1]
    first = group_representatives(group, groups)

    def sub(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[first, :C]

    prefix = decoder(
        input_ids=input_ids[first, :C],
        attention_mask=sub(attention_mask),
        position_ids=sub(position_ids),
        use_cache=True,
    )
    cache = prefix.cache if getattr(prefix, "cache", None) is not None else prefix.past_key_values
    cache.reorder_cache(group)  # index_select along the batch: differentiable, gradients summed per group
    rest = decoder(
        input_ids=input_ids[:, C : T - 1],
        attention_mask=None if attention_mask is None else attention_mask[:, : T - 1],
        position_ids=None if position_ids is None else position_ids[:, C : T - 1],
        use_cache=True,
        **{cache_kwarg: cache},
    ).last_hidden_state  # (B, T - 1 - C, H)
    last = prefix.last_hidden_state  # (groups, C, H)
    return torch.cat([rows_of(last, group[:, None] * C + C - 1), rest], dim=1)


__all__ = [
    "DecoderFacts",
    "best_piece_size",
    "decoder_facts",
    "deterministic_algorithms",
    "layout_mask_kind",
    "pass_cost",
    "plain_hidden",
    "rows_of",
    "scoring_hidden",
]

"""The decoding loop: left-padded token ids -> sampled continuations with their log-probs, under no gradient.

:func:`sample` knows nothing about tokenization: it takes left-padded token ids and a causal LM that maps
``(input_ids, attention_mask, position_ids, past_key_values)`` to logits and an updated KV cache (any Hugging Face
causal LM, align's :class:`~align.models.decoding.FastDecoder`, or a mock with uniform logits in the tests). It
samples with temperature, top-k and top-p, stops a row at its first stop token and the whole batch as soon as every
row has stopped, can forbid stopping before ``min_new_tokens``, and records the log-prob of every sampled token.
The settings every generation engine reads are :class:`align.rollout.engine.SamplingConfig`.

Log-probs are computed as :meth:`align.models.policy.PolicyModel.token_logprobs` computes them in training: the
log-softmax of ``logits / temperature`` over the *full* vocabulary, in float32. Top-k, top-p and
the minimum length only restrict which token is drawn; they do not renormalise the recorded log-probs, so
the old and new policy of a PPO/GRPO ratio are the same distribution. With ``temperature=0`` (greedy) the
log-probs are those of temperature 1. Position ids follow the attention mask (``cumsum - 1``), as in
training, so left padding does not shift them.

Departure from ``transformers.generate``: a stop token ends a row and is kept (the response mask includes
it); rows that stopped are filled with the pad id; a response cut at ``max_new_tokens`` gets no stop token
appended (docs/algorithms.md, "Response mask").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["SampleOutput", "sample", "left_pad", "filter_logits"]

TokenIds = int | Sequence[int]


class SampleOutput:
    """Output of :func:`sample`. ``T`` is the number of decoding steps run (``<= max_new_tokens``)."""

    def __init__(self, response_ids: torch.Tensor, logprobs: torch.Tensor, steps: int):
        self.response_ids = response_ids  # (B, T) long, pad after a row's first stop token
        self.logprobs = logprobs  # (B, T) float32, 0 after a row's first stop token
        self.steps = steps


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists into ``(input_ids, attention_mask)``, both ``(B, P)`` long."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("left_pad: every prompt needs at least one token")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids, mask


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k / top-p (nucleus) support to ``-inf``. ``logits``: ``(B, V)``.

    Nucleus sampling (Holtzman et al. 2019, arXiv 1904.09751) keeps the most likely tokens up to and
    including the first one at which the cumulative probability reaches ``top_p``; the most likely
    token is always kept.
    """
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _as_id_tensor(ids: TokenIds, device) -> torch.Tensor:
    return torch.as_tensor([ids] if isinstance(ids, int) else list(ids), dtype=torch.long, device=device)


@torch.inference_mode()
def sample(
    model: Callable[..., Any],
    input_ids: torch.Tensor,  # (B, P) left-padded
    attention_mask: torch.Tensor,  # (B, P)
    *,
    eos_token_id: TokenIds,
    pad_token_id: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_new_tokens: int = 0,
    generator: torch.Generator | None = None,
    sync_stop: Callable[[bool], bool] | None = None,
    shared_prefix: int = 1,
) -> SampleOutput:
    """Sample up to ``max_new_tokens`` tokens per row with a KV cache; see the module docstring.

    ``shared_prefix``: the rows come in consecutive groups of this many identical prompts. The prompt of each
    group is then encoded once and its KV cache and first logits repeated for the group's rows, which saves
    ``(1 - 1/shared_prefix)`` of the prefill. Used when the model's cache can be repeated in place
    (:class:`~align.models.decoding.DecodeCache` and transformers' caches); otherwise every row is encoded.

    ``sync_stop(all_rows_done) -> stop`` makes the early-stop decision shared when several processes must run
    the same number of forward passes (parameters gathered per layer on use, as under DeepSpeed ZeRO-3): it
    and-s the flag across ranks, and a rank whose rows are done decodes padding until every rank is done.

    Runs in ``torch.inference_mode`` (less per-op overhead than ``no_grad``); clone the outputs before using
    them in autograd. ``model(input_ids=, attention_mask=, position_ids=, past_key_values=, use_cache=True,
    logits_to_keep=1)`` must return an object with ``.logits`` ``(B, t, V)`` and ``.past_key_values``.
    """
    device = input_ids.device
    batch, prompt_width = input_ids.shape
    stop_ids = _as_id_tensor(eos_token_id, device)
    is_stop = (lambda t: t == stop_ids[0]) if stop_ids.numel() == 1 else (lambda t: torch.isin(t, stop_ids))
    # The mask of every step is a prefix of one preallocated mask: no concatenation per token.
    full_mask = torch.cat([attention_mask.long(), attention_mask.new_ones(batch, max_new_tokens, dtype=torch.long)], 1)
    position_ids = (full_mask[:, :prompt_width].cumsum(-1) - 1).clamp(min=0)  # (B, P)
    next_position = position_ids[:, -1:] + 1  # (B, 1)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    pad = torch.full((batch,), pad_token_id, dtype=torch.long, device=device)
    tokens: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    step_ids, cache = input_ids, None
    for step in range(max_new_tokens):
        if step == 0 and shared_prefix > 1 and batch % shared_prefix == 0:
            logits, cache = _shared_prefill(model, input_ids, full_mask[:, :prompt_width], position_ids, shared_prefix)
        else:
            out = model(
                input_ids=step_ids,
                attention_mask=full_mask[:, : prompt_width + step],
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()  # (B, V)
        if temperature > 0:
            logits = logits / temperature
        # One log-softmax serves both the recorded log-prob (the full distribution, as in training) and sampling.
        logp = torch.log_softmax(logits, dim=-1)  # (B, V)
        allowed = logp
        if step < min_new_tokens:
            allowed = allowed.index_fill(-1, stop_ids, float("-inf"))
        if temperature > 0:
            allowed = filter_logits(allowed, top_k, top_p)
            # Exponential race (equivalent to Gumbel-max): argmax p_i / E_i with E_i ~ Exp(1) samples i with
            # probability p_i. E = -log(U), U ~ Uniform[0, 1): on CPU a fraction of the cost of
            # torch.multinomial or Tensor.exponential_.
            exp_noise = torch.rand(allowed.shape, generator=generator, device=allowed.device).log_().neg_()
            token = (allowed - exp_noise.log_()).argmax(dim=-1)  # (B,)
        else:
            token = allowed.argmax(dim=-1)
        logprob = logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)  # (B,)
        tokens.append(torch.where(done, pad, token))
        logprobs.append(logprob.masked_fill(done, 0.0))
        done = done | is_stop(tokens[-1])
        finished = bool(done.all())
        if sync_stop is not None:
            finished = sync_stop(finished)
        if finished:
            break
        step_ids = tokens[-1].unsqueeze(-1)  # (B, 1)
        position_ids = next_position
        next_position = next_position + 1
    return SampleOutput(torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), len(tokens))


def _shared_prefill(model, input_ids, attention_mask, position_ids, group: int) -> tuple[torch.Tensor, Any]:
    """Prefill one row per group, then repeat its cache and last logits ``group`` times. ``(B, V)``, cache."""
    out = model(
        input_ids=input_ids[::group],
        attention_mask=attention_mask[::group],
        position_ids=position_ids[::group],
        past_key_values=None,
        use_cache=True,
        logits_to_keep=1,
    )
    cache = out.past_key_values
    if not hasattr(cache, "batch_repeat_interleave"):  # a cache we cannot widen: encode every row instead
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=None,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].float(), out.past_key_values
    cache.batch_repeat_interleave(group)
    return out.logits[:, -1, :].float().repeat_interleave(group, dim=0), cache

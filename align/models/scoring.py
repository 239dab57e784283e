"""Scoring: log-probs, entropies and values of given tokens under a :class:`~align.models.policy.PolicyModel`.

Three paths compute the same numbers (to float rounding):

* **padded rows, align's own head**: the decoder's final hidden states at the scored positions
  (:func:`~align.models.shared_pass.scoring_hidden`, which runs tokens that several rows share once), then the output
  head and the log-softmax chunk by chunk (:func:`~align.core.linear_head.linear_log_softmax`): the ``(B, R, V)``
  logits never exist at once. Used for the model families in :data:`CHUNKED_HEAD_MODEL_TYPES`;
* **padded rows, the model's own forward** with ``logits_to_keep``, so a model's softcapping or logit scale still
  applies (every other model, see :func:`chunked_head_unsupported`);
* **padding-free**: the rows' real tokens laid end to end (:func:`~align.core.packing.pack_scored_rows`), with either
  head on the scored positions only.

Position ids are always derived from the attention mask (``cumsum - 1``), so a left-padded prompt gets the same
positions in training as in generation, and log-probs of the old and new policy agree.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import nullcontext
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

import torch
import transformers.modeling_utils
from torch import nn

from align.core.linear_head import linear_log_softmax
from align.core.logprobs import entropy_from_logits, selective_log_softmax
from align.core.packing import PackedRows, pack_scored_rows
from align.models.reference import ReferencePolicy, reference_context
from align.models.shared_pass import scoring_hidden

if TYPE_CHECKING:
    from peft import PeftModel
    from torch.utils.hooks import RemovableHandle
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


class TokenLogprobs(NamedTuple):
    """Per-token outputs for the last ``R`` positions of a batch of sequences.

    ``logprobs[:, j]`` is log p(input_ids[:, T-R+j] | input_ids[:, :T-R+j]) at the given temperature.
    """

    logprobs: torch.Tensor  # (B, R) float32
    entropy: torch.Tensor | None  # (B, R) float32
    values: torch.Tensor | None  # (B, R) float32, V(state before token j)


class ValueModel(Protocol):
    """What scoring reads of a policy's critic (:class:`~align.models.critic.Critic`, which imports this module)."""

    @property
    def separate(self) -> bool: ...

    @property
    def head(self) -> nn.Module: ...

    def packed_values(self, packed: PackedRows, index: torch.Tensor) -> torch.Tensor: ...

    def padded_values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        R: int,
    ) -> torch.Tensor: ...


class ScoringPolicy(ReferencePolicy, Protocol):
    """What scoring reads of a :class:`~align.models.policy.PolicyModel` (which imports this module)."""

    @property
    def critic(self) -> ValueModel | None: ...


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so left padding does not shift them. # (B, T)"""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def spread(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` ``(N,)``, one per true entry of ``mask`` in row-major order, laid out in ``mask``'s shape, with 0
    elsewhere (differentiable)."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


def pack_responses(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, R: int
) -> tuple[PackedRows, torch.Tensor, torch.Tensor]:
    """The padded rows' real tokens laid end to end (:func:`~align.core.packing.pack_scored_rows`), the ``(B, R)``
    mask of the real tokens among the last ``R``, and ``(N,)`` the flattened packed positions that predict them,
    in the mask's row-major order."""
    B, T = input_ids.shape
    scored = attention_mask.bool().clone()
    scored[:, : T - R] = False
    packed = pack_scored_rows(input_ids, attention_mask, scored)
    predictors = torch.arange(T - R - 1, T - 1, device=input_ids.device).expand(B, R)
    response = scored[:, T - R :]
    return packed, response, packed.locate(predictors)[response]


# ------------------------------------------------------------------ the output head
# Model families whose causal LM computes ``logits = lm_head(final hidden states)`` and nothing more (no softcapping,
# no logit scale), so that align may apply the head itself, chunked, to the hidden states of its decoder.
CHUNKED_HEAD_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "phi3",
    "olmo2",
    "smollm3",
)


def chunked_head_unsupported(model: nn.Module) -> str | None:
    """Why align cannot apply ``model``'s output head itself, chunked (``None`` when it can)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in CHUNKED_HEAD_MODEL_TYPES:
        return f"model type {model_type!r}"
    head = cast("PreTrainedModel", model).get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return f"an output head of type {type(head).__name__} (an adapter or a replaced layer on the head)"
    if hasattr(head.weight, "ds_id"):
        return "an output head partitioned by DeepSpeed ZeRO-3"
    return None


def contiguous_head_input(model: nn.Module) -> None:
    """Give the output head a contiguous input.

    transformers slices the hidden states for ``logits_to_keep`` (``hidden[:, -k:]``), which is not contiguous.
    When the head's weight needs no gradient (LoRA, the reference pass, a frozen policy) torch then runs the
    head as a batched matmul over a per-row broadcast of the (V, H) weight instead of one matrix multiply:
    on SmolLM2-135M (V = 49,152) that was about a quarter of a LoRA scoring pass. A copy of the kept rows
    costs a fraction of a percent of that.
    """
    head = cast("PreTrainedModel", model).get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Module):
        head.register_forward_pre_hook(_contiguous_if_frozen)


def _contiguous_if_frozen(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
    # A trained head already takes torch's reshape-and-matmul path: leave its numbers exactly as they were.
    weight = getattr(module, "weight", None)
    if not args or weight is None or weight.requires_grad:
        return None
    return (args[0].contiguous(), *args[1:])


def unwrapped(lm: nn.Module) -> nn.Module:
    """The transformers model inside ``lm``: unwrapped from peft when it is a peft model."""
    return cast("PeftModel", lm).get_base_model() if hasattr(lm, "get_base_model") else lm


def decoder_of(lm: nn.Module) -> nn.Module:
    """The transformers decoder (embeddings, layers, final norm) inside ``lm``, a peft wrapper included."""
    decoder: nn.Module = cast("PreTrainedModel", unwrapped(lm)).get_decoder()
    return decoder


_FALLBACK_REPORTED: weakref.WeakSet[object] = weakref.WeakSet()  # the policies whose first fallback was reported


def own_head(lm: nn.Module, owner: object) -> nn.Linear | None:
    """``lm``'s output head when align applies it itself, chunked (see :func:`chunked_head_unsupported`);
    ``None``: the model's own forward computes the logits. The first fallback of each ``owner`` is reported."""
    base = unwrapped(lm)
    reason = chunked_head_unsupported(base)
    if reason is None:
        head: nn.Linear = cast("PreTrainedModel", base).get_output_embeddings()  # a plain nn.Linear: checked above
        return head
    if owner not in _FALLBACK_REPORTED:
        _FALLBACK_REPORTED.add(owner)
        log.info(
            "policy: full-vocabulary logits for %s (the chunked output head covers plain linear heads of %s models)",
            reason,
            ", ".join(CHUNKED_HEAD_MODEL_TYPES),
        )
    return None


def _keep_hidden(lm: nn.Module, kept: list[torch.Tensor]) -> RemovableHandle:
    """A forward hook on ``lm``'s decoder that appends its final hidden states to ``kept``."""
    return decoder_of(lm).register_forward_hook(
        lambda m, a, out: kept.append(out[0] if isinstance(out, tuple) else out.last_hidden_state)
    )


def scores_at(
    policy: object,
    lm: nn.Module,
    input_ids: torch.Tensor,  # (B, T)
    attention_mask: torch.Tensor | None,  # (B, T)
    position_ids: torch.Tensor | None,  # (B, T)
    index: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    keep_hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(logprobs, entropy, hidden)``, each ``(N, ...)``, of ``targets`` ``(N,)`` as predicted at the positions
    ``index`` ``(N,)`` (in any order) of the flattened ``(B * T)`` rows of one forward pass of ``lm``.

    Only those positions go through the output head: align's own chunked head on the selected hidden states,
    otherwise transformers' ``logits_to_keep`` mask (so a model's softcapping or logit scale still applies).
    ``hidden`` (the final hidden states at ``index``) is returned with the own head, or when ``keep_hidden``.
    """
    head = own_head(lm, policy)
    if head is not None:
        hidden = decoder_of(lm)(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state.flatten(0, 1)[index]
        logprobs, entropy = linear_log_softmax(
            hidden, head.weight, targets, bias=head.bias, temperature=temperature, return_entropy=return_entropy
        )
        return logprobs, entropy, hidden
    base = unwrapped(lm)
    # Transformers versions with ``slice_logits_to_keep`` take a (B, T) bool mask and return (N, V) logits in
    # row-major order; models loaded with their own code (trust_remote_code) may not.
    by_mask = hasattr(transformers.modeling_utils, "slice_logits_to_keep") and type(base).__module__.startswith(
        "transformers.models."
    )
    keep = torch.zeros(input_ids.numel(), dtype=torch.bool, device=input_ids.device)
    keep = keep.index_fill_(0, index, True).view_as(input_ids)
    kept: list[torch.Tensor] = []
    hook = _keep_hidden(lm, kept) if keep_hidden else None
    try:
        out = lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **({"logits_to_keep": keep} if by_mask else {}),
        )
    finally:
        if hook is not None:
            hook.remove()
    logits = out.logits if out.logits.dim() == 2 else out.logits[keep]  # (N, V), row-major
    ordered, _ = index.sort()
    if not torch.equal(ordered, index):  # the logits come in row-major order: put them in index's
        logits = logits[torch.searchsorted(ordered, index)]
    logprobs = selective_log_softmax(logits, targets, temperature)
    entropy = entropy_from_logits(logits, temperature=temperature) if return_entropy else None
    return logprobs, entropy, kept[0].flatten(0, 1)[index] if kept else None


def _critic(policy: ScoringPolicy) -> ValueModel:
    if policy.critic is None:
        raise RuntimeError("values requested but the policy has no critic; set policy.critic")
    return policy.critic


# ------------------------------------------------------------------ the scoring passes
def token_logprobs(
    policy: ScoringPolicy,
    input_ids: torch.Tensor,  # (B, T)
    attention_mask: torch.Tensor | None = None,  # (B, T)
    *,
    response_length: int | None = None,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    return_values: bool = False,
    reference: bool = False,
    padding_free: bool = False,
) -> TokenLogprobs:
    """Log-probs (and optionally entropy and the critic's values) of the last ``response_length`` tokens.

    Only the needed positions go through the output head, and log-probs are gathered without keeping a
    full-vocabulary log-softmax. ``response_length=None`` scores every token after the first. ``reference=True``
    scores with the reference model (:func:`~align.models.reference.reference_context`; no values).

    ``padding_free``: run the rows' real tokens laid end to end (:func:`align.core.packing.pack_scored_rows`)
    instead of the padded rows, and score only the real response tokens (those of ``attention_mask``); the
    outputs at padded response positions are 0. Each row's real tokens must be contiguous (a left-padded
    prompt and a right-padded response). Shared tokens are not run once there
    (:func:`align.models.shared_pass.scoring_hidden` covers padded rows).
    """
    T = input_ids.shape[1]
    R = T - 1 if response_length is None else response_length
    if not 0 < R < T:
        raise ValueError(f"response_length must be in [1, {T - 1}], got {R}")
    critic = _critic(policy) if return_values and not reference else None
    shared_head = critic is not None and not critic.separate
    ctx = reference_context(policy) if reference else nullcontext(policy.model)
    if padding_free and attention_mask is not None:
        packed, scored, index = pack_responses(input_ids, attention_mask, R)
        with ctx as lm:
            logprobs, entropy, hidden = scores_at(
                policy,
                lm,
                packed.input_ids,
                None,
                packed.position_ids,
                index,
                input_ids[:, T - R :][scored],
                temperature,
                return_entropy,
                shared_head,
            )
        values = None
        if critic is not None:
            values = critic.head(hidden) if shared_head else critic.packed_values(packed, index)
        return TokenLogprobs(
            spread(scored, logprobs),
            None if entropy is None else spread(scored, entropy),
            None if values is None else spread(scored, values),
        )
    if position_ids is None and attention_mask is not None:
        position_ids = position_ids_from_mask(attention_mask)
    targets = input_ids[:, T - R :]
    with ctx as lm:
        head = own_head(lm, policy)
        if head is not None:
            # Hidden states of the positions that predict a response token (T-R-1+j predicts T-R+j), then the
            # head and the log-softmax chunk by chunk: the (B, R, V) logits never exist at once.
            hidden = scoring_hidden(decoder_of(lm), input_ids, attention_mask, position_ids, R)
            logprobs, entropy = linear_log_softmax(
                hidden, head.weight, targets, bias=head.bias, temperature=temperature, return_entropy=return_entropy
            )
            values = None
            if critic is not None:
                values = (
                    critic.head(hidden)
                    if shared_head
                    else critic.padded_values(input_ids, attention_mask, position_ids, R)
                )
            return TokenLogprobs(logprobs, entropy, values)
        kept: list[torch.Tensor] = []
        hook = _keep_hidden(lm, kept) if shared_head else None
        try:
            out = lm(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                logits_to_keep=R + 1,
                use_cache=False,
            )
        finally:
            if hook is not None:
                hook.remove()
    logits = out.logits[:, :-1]  # (B, R, V): position T-R-1+j predicts token T-R+j
    # The temperature divides after the per-chunk upcast, as in the sampler: dividing bf16 logits first
    # would round them and shift every log-prob (and so every importance ratio) away from the sampler's.
    logprobs = selective_log_softmax(logits, targets, temperature)
    entropy = entropy_from_logits(logits, temperature=temperature) if return_entropy else None
    values = None
    if critic is not None:
        values = (
            critic.head(kept[0][:, T - R - 1 : T - 1])
            if shared_head
            else critic.padded_values(input_ids, attention_mask, position_ids, R)
        )
    return TokenLogprobs(logprobs, entropy, values)


def next_token_logprobs(
    policy: ScoringPolicy,
    input_ids: torch.Tensor,  # (B, T)
    targets: torch.Tensor,  # (B, T) long: the token each position predicts, ``ignore_index`` where none
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    reference: bool = False,
) -> torch.Tensor:
    """``(N,)`` float32 log-probs of ``targets`` at the positions that have one, in row-major order, at
    ``temperature``.

    Only those positions go through the output head (prompts, padding and the last position of a packed
    segment need no logits): with align's own chunked head on the selected hidden states, otherwise through
    transformers' ``logits_to_keep`` mask (so a model's softcapping or logit scale still applies).
    ``reference=True`` scores with the reference model.
    """
    if position_ids is None and attention_mask is not None:
        position_ids = position_ids_from_mask(attention_mask)
    keep = targets != ignore_index  # (B, T)
    ctx = reference_context(policy) if reference else nullcontext(policy.model)
    with ctx as lm:
        return scores_at(
            policy,
            lm,
            input_ids,
            attention_mask,
            position_ids,
            keep.flatten().nonzero().squeeze(1),
            targets[keep],
            temperature,
        )[0]


def response_logits(
    policy: ScoringPolicy,
    input_ids: torch.Tensor,  # (B, T)
    attention_mask: torch.Tensor | None = None,
    *,
    response_length: int,
    reference: bool = False,
) -> torch.Tensor:
    """``(B, R, V)`` logits of the positions that predict the last ``R = response_length`` tokens (position
    ``T-R-1+j`` predicts token ``T-R+j``), for losses over whole next-token distributions (GKD). Only those
    positions go through the output head (``logits_to_keep``); the full ``(B, R, V)`` tensor is materialised, so
    keep micro-batches small on large vocabularies. ``reference=True``: with the reference model."""
    T = input_ids.shape[1]
    if not 0 < response_length < T:
        raise ValueError(f"response_length must be in [1, {T - 1}], got {response_length}")
    position_ids = position_ids_from_mask(attention_mask) if attention_mask is not None else None
    ctx = reference_context(policy) if reference else nullcontext(policy.model)
    with ctx as lm:
        out = lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=response_length + 1,
            use_cache=False,
        )
    logits: torch.Tensor = out.logits[:, :-1]  # (B, R, V)
    return logits

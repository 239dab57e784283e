"""``PolicyModel``: the one model wrapper shared by SFT, reward modelling, DPO, PPO and GRPO.

It owns the causal LM (optionally LoRA / QLoRA), its tokenizer, an optional value head or separate critic,
and the reference model. The reference is the policy with its adapter disabled when LoRA is on (no second
copy is kept), a frozen copy of the initial policy otherwise, or a separately loaded model.

Position ids are always derived from the attention mask (``cumsum - 1``), so a left-padded prompt gets the
same positions in training as in generation, and log-probs of the old and new policy agree.
"""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Iterator, Literal, NamedTuple

import torch
import transformers.modeling_utils
from torch import nn

from align.errors import AlignConfigError
from align.hub import check_model_source, load_tokenizer
from align.core.logprobs import entropy_from_logits, linear_log_softmax, selective_log_softmax
from align.models.loading import (
    DType,
    LoraSettings,
    Quantization,
    load_causal_lm,
    load_decoder,
    reward_head_state,
    torch_dtype,
)
from align.models.lora import fuse_lora_layers
from align.models.shared_pass import scoring_hidden
from align.core.packing import PackedRows, pack_scored_rows

log = logging.getLogger(__name__)


def _spread(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` ``(N,)``, one per true entry of ``mask`` in row-major order, laid out in ``mask``'s shape, with 0
    elsewhere (differentiable)."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


class TokenLogprobs(NamedTuple):
    """Per-token outputs for the last ``R`` positions of a batch of sequences.

    ``logprobs[:, j]`` is log p(input_ids[:, T-R+j] | input_ids[:, :T-R+j]) at the given temperature.
    """

    logprobs: torch.Tensor  # (B, R) float32
    entropy: torch.Tensor | None  # (B, R) float32
    values: torch.Tensor | None  # (B, R) float32, V(state before token j)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so left padding does not shift them. # (B, T)"""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _contiguous_head_input(model: nn.Module) -> None:
    """Give the output head a contiguous input.

    transformers slices the hidden states for ``logits_to_keep`` (``hidden[:, -k:]``), which is not contiguous.
    When the head's weight needs no gradient (LoRA, the reference pass, a frozen policy) torch then runs the
    head as a batched matmul over a per-row broadcast of the (V, H) weight instead of one matrix multiply:
    on SmolLM2-135M (V = 49,152) that was about a quarter of a LoRA scoring pass. A copy of the kept rows
    costs a fraction of a percent of that.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Module):
        head.register_forward_pre_hook(_contiguous_if_frozen)


def _contiguous_if_frozen(module: nn.Module, args: tuple):
    # A trained head already takes torch's reshape-and-matmul path: leave its numbers exactly as they were.
    weight = getattr(module, "weight", None)
    if not args or weight is None or weight.requires_grad:
        return None
    return (args[0].contiguous(), *args[1:])


# Model families whose causal LM computes ``logits = lm_head(final hidden states)`` and nothing more (no softcapping,
# no logit scale), so that align may apply the head itself, chunked, to the hidden states of its decoder.
CHUNKED_HEAD_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3",
                            "olmo2", "smollm3")


def chunked_head_unsupported(model: nn.Module) -> str | None:
    """Why align cannot apply ``model``'s output head itself, chunked (``None`` when it can)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in CHUNKED_HEAD_MODEL_TYPES:
        return f"model type {model_type!r}"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return f"an output head of type {type(head).__name__} (an adapter or a replaced layer on the head)"
    if hasattr(head.weight, "ds_id"):
        return "an output head partitioned by DeepSpeed ZeRO-3"
    return None


def _adapter_switch_types() -> tuple[type, ...]:
    """peft module types that ``enable_adapters(False)`` returns to the base model's computation."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:  # peft >= 0.15: the base class of ModulesToSaveWrapper and TrainableTokensWrapper
        from peft.utils.other import AuxiliaryTrainingWrapper as Wrapper
    except ImportError:  # pragma: no cover - older peft
        from peft.utils.other import ModulesToSaveWrapper as Wrapper
    return BaseTunerLayer, Wrapper


class ValueHead(nn.Module):
    """A scalar per token on top of final hidden states (zero-initialised: the critic starts at V = 0)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden.to(self.proj.weight.dtype)).squeeze(-1).float()


class PolicyModel(nn.Module):
    def __init__(
        self,
        model: str = "tiny",
        tokenizer: str | None = None,
        dtype: DType = "float32",
        lora: LoraSettings | None = None,
        quantization: Quantization | None = None,
        gradient_checkpointing: bool = False,
        value_head: Literal["shared", "separate"] | None = None,
        critic_model: str | None = None,
        critic_head_from_reward_model: bool = True,
        reference_model: str | None = None,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        revision: str | None = None,
        pad_equals_eos: bool = False,
        seed: int = 0,
    ):
        """
        Args:
            model: ``tiny`` (the embedded default), a local Hugging Face model directory, or a hub id.
            tokenizer: Tokenizer path or id; defaults to ``model``.
            dtype: Weight dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto`` (as saved).
            lora: LoRA adapter settings; null trains every weight.
            quantization: ``4bit`` (nf4, double quantization) or ``8bit`` base weights for QLoRA; needs ``lora``.
            gradient_checkpointing: Recompute activations in the backward pass to save memory.
            value_head: ``shared``: a scalar head on the policy backbone; ``separate``: a critic with its own
                backbone loaded from ``critic_model``; null: no values.
            critic_model: Backbone of the separate critic (for example a trained reward model); defaults to ``model``.
            critic_head_from_reward_model: When ``critic_model`` is a reward model (any export or checkpoint that
                :class:`~align.models.reward.RewardModelScorer` loads), start the critic's head from its reward
                head, so the critic starts by predicting the reward model's score of each prefix instead of 0.
            reference_model: Load the reference from here instead of using the initial policy.
            attn_implementation: ``sdpa``, ``eager`` or ``flash_attention_2``; null lets transformers choose.
            trust_remote_code: Run model code shipped with a checkpoint. Off unless you trust the source.
            revision: Hub revision (branch, tag or commit) for ``model``.
            pad_equals_eos: Use the EOS token as pad (the tiny tokenizer ships both variants).
            seed: Weight seed of the embedded tiny model (ignored for real models).
        """
        super().__init__()
        if quantization is not None and lora is None:
            raise AlignConfigError("policy.quantization: a quantized base cannot be trained in full; also set policy.lora")
        if value_head not in (None, "shared", "separate"):
            raise AlignConfigError(f"policy.value_head: expected 'shared', 'separate' or null, got {value_head!r}")
        self.spec = {
            "model": model, "tokenizer": tokenizer, "dtype": dtype, "lora": asdict(lora) if lora else None,
            "quantization": quantization, "value_head": value_head, "critic_model": critic_model,
            "critic_head_from_reward_model": critic_head_from_reward_model,
            "reference_model": reference_model, "attn_implementation": attn_implementation,
            "trust_remote_code": trust_remote_code, "revision": revision, "pad_equals_eos": pad_equals_eos, "seed": seed,
        }
        self._load_kwargs = dict(dtype=dtype, trust_remote_code=trust_remote_code, revision=revision,
                                 attn_implementation=attn_implementation, seed=seed)
        check_model_source(model)  # before the tokenizer, so a bad model path is reported as such
        self.tokenizer = load_tokenizer(tokenizer or model, trust_remote_code=trust_remote_code, revision=revision,
                                        pad_equals_eos=pad_equals_eos)
        base = load_causal_lm(model, quantization=quantization, **self._load_kwargs)
        if len(self.tokenizer) > base.get_input_embeddings().num_embeddings:
            raise AlignConfigError(
                f"policy.tokenizer has {len(self.tokenizer)} tokens but the model's embedding has "
                f"{base.get_input_embeddings().num_embeddings}; use the model's own tokenizer"
            )
        base.config.pad_token_id = self.tokenizer.pad_token_id
        _contiguous_head_input(base)
        if quantization is not None:
            from peft import prepare_model_for_kbit_training

            base = prepare_model_for_kbit_training(
                base, use_gradient_checkpointing=gradient_checkpointing,
                gradient_checkpointing_kwargs={"use_reentrant": False},
            )
        elif gradient_checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora is not None:
            from peft import get_peft_model

            base = get_peft_model(base, lora.to_peft())
            if lora.fused:
                fuse_lora_layers(base)
        self.model = base
        self.lora = lora
        self.value_head = ValueHead(self.config.hidden_size) if value_head == "shared" else None
        self.critic: nn.Module | None = None
        self.critic_head: ValueHead | None = None
        if value_head == "separate":
            self.critic = load_decoder(critic_model or model, **self._load_kwargs)
            self.critic_head = ValueHead(self.critic.config.hidden_size)
            if critic_head_from_reward_model:
                self.init_critic_head_from_reward_model()
        self.ref_model: nn.Module | None = None
        self.train()  # transformers returns models in eval mode; a wrapper built for training starts in train mode

    def init_critic_head_from_reward_model(self) -> bool:
        """Load the reward head of ``critic_model`` (or ``model``) into the separate critic's head when that
        backbone is a reward model. Returns whether it did."""
        if self.critic_head is None:
            return False
        state = reward_head_state(self.spec["critic_model"] or self.spec["model"])
        if state is None:
            return False
        head = self.critic_head.proj
        self.critic_head.load_state_dict({k: v.to(head.weight.dtype) for k, v in state.items()})
        return True

    def train(self, mode: bool = True) -> "PolicyModel":
        super().train(mode)
        if self.ref_model is not None:
            self.ref_model.eval()  # the reference never runs dropout
        return self

    def disable_dropout(self) -> None:
        """Set every dropout of the model, adapter, value head, critic and reference to 0.

        Covers ``nn.Dropout`` modules (LoRA's ``lora_dropout`` included) and the float ``attention_dropout``
        that transformers' attention layers pass to their kernels in train mode. With dropout off, the
        training forward pass computes the same log-probs as the sampler and the reference (eval mode), so an
        importance ratio is exactly 1 before the first update.
        """
        for module in self.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd):
                module.p = 0.0
            if isinstance(getattr(module, "attention_dropout", None), float):
                module.attention_dropout = 0.0
            config = getattr(module, "config", None)
            for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop"):
                if isinstance(getattr(config, name, None), float):
                    setattr(config, name, 0.0)

    # ------------------------------------------------------------------ properties
    @property
    def config(self):
        return self.model.config

    @property
    def has_adapter(self) -> bool:
        return self.lora is not None

    @property
    def base_model(self) -> nn.Module:
        """The underlying transformers model (unwrapped from peft)."""
        return self.model.get_base_model() if self.has_adapter else self.model

    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        return (p for p in self.parameters() if p.requires_grad)

    # ------------------------------------------------------------------ reference
    def setup_reference(self) -> None:
        """Make a reference model available to :meth:`token_logprobs` with ``reference=True``. Idempotent.

        With LoRA the reference is the adapter-disabled policy and nothing is copied: every LoRA layer and every
        module trained in full beside it (``lora.modules_to_save``) is switched to the base weights. Trained
        biases (``lora.bias``) change the base layers themselves, so they need a separate ``reference_model``.
        Otherwise a frozen copy of the current (initial) weights is kept, or ``reference_model`` is loaded.
        """
        if self.ref_model is not None:
            return
        if self.has_adapter and not self.spec["reference_model"]:
            if self.lora.bias != "none":
                raise AlignConfigError(
                    f"policy.lora.bias: {self.lora.bias!r} trains the base model's biases, so the adapter-disabled "
                    "model is no longer the initial one and cannot be the reference; use bias: none, or set "
                    "policy.reference_model to the base model"
                )
            return
        if self.spec["reference_model"]:
            ref = load_causal_lm(self.spec["reference_model"], **self._load_kwargs)
        else:
            ref = copy.deepcopy(self.model)
        ref.requires_grad_(False).eval()
        self.ref_model = ref

    @contextmanager
    def _reference_context(self):
        if self.ref_model is not None:
            yield self.ref_model
        elif self.has_adapter:
            with self._adapters_off():
                yield self.model
        else:
            raise RuntimeError("no reference model: call PolicyModel.setup_reference() first")

    @contextmanager
    def _adapters_off(self):
        """peft's ``disable_adapter`` without its per-call status walk over every module.

        As in peft, both the LoRA layers and the auxiliary wrappers (``modules_to_save``, trainable tokens) are
        switched off, so the model computes with its base weights only. peft's context inspects the whole model
        (``get_model_status``) on each entry, which costs tens of milliseconds per reference forward on small
        models; the switchable modules are found once here instead.

        Without gradients (every reference pass) only each module's switch is flipped: that is all its forward
        reads. ``enable_adapters`` also sets ``requires_grad`` on every adapter tensor, off and then on again, a
        walk that cost a few milliseconds per pass on the tiny model and changes nothing a no-grad pass computes.
        """
        layers = getattr(self, "_adapter_switches", None)
        if layers is None:
            kinds = _adapter_switch_types()
            layers = self._adapter_switches = [m for m in self.model.modules() if isinstance(m, kinds)]
            self._adapter_switch_flags = all(hasattr(layer, "_disable_adapters") for layer in layers)
        was_off = [layer.disable_adapters for layer in layers]
        switch_only = not torch.is_grad_enabled() and self._adapter_switch_flags
        try:
            for layer in layers:
                if switch_only:
                    layer._disable_adapters = True
                else:
                    layer.enable_adapters(False)
            yield
        finally:
            for layer, off in zip(layers, was_off):
                if switch_only:
                    layer._disable_adapters = off
                elif not off:
                    layer.enable_adapters(True)

    # ------------------------------------------------------------------ forward passes
    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        if position_ids is None and attention_mask is not None:
            position_ids = position_ids_from_mask(attention_mask)
        # Without a cache: transformers only honours packed position ids when no cache is passed.
        kwargs.setdefault("use_cache", False)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)

    def token_logprobs(
        self,
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
        """Log-probs (and optionally entropy and values) of the last ``response_length`` tokens.

        Only the needed positions go through the output head, and log-probs are gathered without keeping a
        full-vocabulary log-softmax. ``response_length=None`` scores every token after the first.

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
        want_values = return_values and not reference
        ctx = self._reference_context() if reference else nullcontext(self.model)
        if padding_free and attention_mask is not None:
            packed, scored, index = self._pack_responses(input_ids, attention_mask, R)
            with ctx as lm:
                keep_hidden = want_values and self.value_head is not None
                logprobs, entropy, hidden = self._scores_at(
                    lm, packed.input_ids, None, packed.position_ids, index, input_ids[:, T - R:][scored],
                    temperature, return_entropy, keep_hidden)
            values = None
            if want_values:
                values = self.value_head(hidden) if keep_hidden else self._critic_values_at(packed, index)
            return TokenLogprobs(*(None if x is None else _spread(scored, x) for x in (logprobs, entropy, values)))
        if position_ids is None and attention_mask is not None:
            position_ids = position_ids_from_mask(attention_mask)
        targets = input_ids[:, T - R:]
        with ctx as lm:
            head = self._own_head(lm)
            if head is not None:
                # Hidden states of the positions that predict a response token (T-R-1+j predicts T-R+j), then the
                # head and the log-softmax chunk by chunk: the (B, R, V) logits never exist at once.
                hidden = scoring_hidden(self._decoder(lm), input_ids, attention_mask, position_ids, R)
                logprobs, entropy = linear_log_softmax(hidden, head.weight, targets, bias=head.bias,
                                                       temperature=temperature, return_entropy=return_entropy)
                values = None
                if want_values:
                    values = (self.value_head(hidden) if self.value_head is not None
                              else self._values(None, input_ids, attention_mask, position_ids, R))
                return TokenLogprobs(logprobs, entropy, values)
            kept: list[torch.Tensor] = []
            hook = None
            if want_values and self.value_head is not None:
                hook = self._decoder(lm).register_forward_hook(
                    lambda m, a, out: kept.append(out[0] if isinstance(out, tuple) else out.last_hidden_state))
            try:
                out = lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         logits_to_keep=R + 1, use_cache=False)
            finally:
                if hook is not None:
                    hook.remove()
        logits = out.logits[:, :-1]  # (B, R, V): position T-R-1+j predicts token T-R+j
        # The temperature divides after the per-chunk upcast, as in the sampler: dividing bf16 logits first
        # would round them and shift every log-prob (and so every importance ratio) away from the sampler's.
        logprobs = selective_log_softmax(logits, targets, temperature)
        entropy = entropy_from_logits(logits, temperature=temperature) if return_entropy else None
        values = None
        if want_values:
            values = self._values(kept[0] if kept else None, input_ids, attention_mask, position_ids, R)
        return TokenLogprobs(logprobs, entropy, values)

    def next_token_logprobs(
        self,
        input_ids: torch.Tensor,  # (B, T)
        targets: torch.Tensor,  # (B, T) long: the token each position predicts, ``ignore_index`` where none
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        ignore_index: int = -100,
        reference: bool = False,
    ) -> torch.Tensor:
        """``(N,)`` float32 log-probs of ``targets`` at the positions that have one, in row-major order.

        Only those positions go through the output head (prompts, padding and the last position of a packed
        segment need no logits): with align's own chunked head on the selected hidden states, otherwise through
        transformers' ``logits_to_keep`` mask (so a model's softcapping or logit scale still applies).
        ``reference=True`` scores with the reference model (see :meth:`setup_reference`).
        """
        if position_ids is None and attention_mask is not None:
            position_ids = position_ids_from_mask(attention_mask)
        keep = targets != ignore_index  # (B, T)
        ctx = self._reference_context() if reference else nullcontext(self.model)
        with ctx as lm:
            return self._scores_at(lm, input_ids, attention_mask, position_ids, keep.flatten().nonzero().squeeze(1),
                                   targets[keep])[0]

    def _scores_at(self, lm: nn.Module, input_ids, attention_mask, position_ids, index: torch.Tensor,
                   targets: torch.Tensor, temperature: float = 1.0, return_entropy: bool = False,
                   keep_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(logprobs, entropy, hidden)``, each ``(N, ...)``, of ``targets`` ``(N,)`` as predicted at the positions
        ``index`` ``(N,)`` (in any order) of the flattened ``(B * T)`` rows of one forward pass of ``lm``.

        Only those positions go through the output head: align's own chunked head on the selected hidden states,
        otherwise transformers' ``logits_to_keep`` mask (so a model's softcapping or logit scale still applies).
        ``hidden`` (the final hidden states at ``index``) is returned with the own head, or when ``keep_hidden``.
        """
        head = self._own_head(lm)
        if head is not None:
            hidden = self._decoder(lm)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       use_cache=False).last_hidden_state.flatten(0, 1)[index]
            logprobs, entropy = linear_log_softmax(hidden, head.weight, targets, bias=head.bias,
                                                   temperature=temperature, return_entropy=return_entropy)
            return logprobs, entropy, hidden
        base = self._unwrapped(lm)
        # Transformers versions with ``slice_logits_to_keep`` take a (B, T) bool mask and return (N, V) logits in
        # row-major order; models loaded with their own code (trust_remote_code) may not.
        by_mask = (hasattr(transformers.modeling_utils, "slice_logits_to_keep")
                   and type(base).__module__.startswith("transformers.models."))
        keep = torch.zeros(input_ids.numel(), dtype=torch.bool, device=input_ids.device)
        keep = keep.index_fill_(0, index, True).view_as(input_ids)
        kept: list[torch.Tensor] = []
        hook = None
        if keep_hidden:
            hook = self._decoder(lm).register_forward_hook(
                lambda m, a, out: kept.append(out[0] if isinstance(out, tuple) else out.last_hidden_state))
        try:
            out = lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     use_cache=False, **({"logits_to_keep": keep} if by_mask else {}))
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

    @staticmethod
    def _pack_responses(input_ids: torch.Tensor, attention_mask: torch.Tensor, R: int
                        ) -> tuple[PackedRows, torch.Tensor, torch.Tensor]:
        """The padded rows' real tokens laid end to end (:func:`~align.core.packing.pack_scored_rows`), the ``(B, R)``
        mask of the real tokens among the last ``R``, and ``(N,)`` the flattened packed positions that predict
        them, in the mask's row-major order."""
        B, T = input_ids.shape
        scored = attention_mask.bool().clone()
        scored[:, : T - R] = False
        packed = pack_scored_rows(input_ids, attention_mask, scored)
        predictors = torch.arange(T - R - 1, T - 1, device=input_ids.device).expand(B, R)
        response = scored[:, T - R:]
        return packed, response, packed.locate(predictors)[response]

    def _critic_values_at(self, packed: PackedRows, index: torch.Tensor) -> torch.Tensor:
        """``(N,)`` values of the separate critic at the flattened positions ``index`` of ``packed``'s rows."""
        if self.critic is None:
            raise RuntimeError("values requested but the policy has no value head; set policy.value_head")
        hidden = self.critic(input_ids=packed.input_ids, position_ids=packed.position_ids,
                             use_cache=False).last_hidden_state
        return self.critic_head(hidden.flatten(0, 1)[index])

    @staticmethod
    def _unwrapped(lm: nn.Module) -> nn.Module:
        """The transformers model inside ``lm``: unwrapped from peft when it is a peft model."""
        return lm.get_base_model() if hasattr(lm, "get_base_model") else lm

    @classmethod
    def _decoder(cls, lm: nn.Module) -> nn.Module:
        """The transformers decoder (embeddings, layers, final norm) inside ``lm``, a peft wrapper included."""
        return cls._unwrapped(lm).get_decoder()

    def _own_head(self, lm: nn.Module) -> nn.Linear | None:
        """``lm``'s output head when align applies it itself, chunked (see :func:`chunked_head_unsupported`);
        ``None``: the model's own forward computes the logits. The first fallback is reported once."""
        base = self._unwrapped(lm)
        reason = chunked_head_unsupported(base)
        if reason is None:
            return base.get_output_embeddings()
        if not getattr(self, "_head_fallback_reported", False):
            self._head_fallback_reported = True
            log.info("policy: full-vocabulary logits for %s (the chunked output head covers plain linear heads "
                     "of %s models)", reason, ", ".join(CHUNKED_HEAD_MODEL_TYPES))
        return None

    def _values(self, hidden, input_ids, attention_mask, position_ids, R) -> torch.Tensor:
        """``(B, R)`` values: the shared head's on ``hidden`` (the policy's ``(B, T, H)`` final hidden states), or
        the separate critic's own pass (:func:`~align.models.shared_pass.scoring_hidden`)."""
        T = input_ids.shape[1]
        if self.value_head is not None:
            return self.value_head(hidden[:, T - R - 1 : T - 1])
        if self.critic is not None:
            return self.critic_head(scoring_hidden(self.critic, input_ids, attention_mask, position_ids, R))
        raise RuntimeError("values requested but the policy has no value head; set policy.value_head")

    def values(
        self,
        input_ids: torch.Tensor,  # (B, T)
        attention_mask: torch.Tensor | None = None,  # (B, T)
        *,
        response_length: int,
        position_ids: torch.Tensor | None = None,
        detach_backbone: bool = False,
        padding_free: bool = False,
    ) -> torch.Tensor:
        """``(B, R)`` float32 values ``V(state before token j)`` of the last ``R`` tokens, without the LM head.

        The same numbers as ``token_logprobs(..., return_values=True).values``; for a value-only update or a
        rollout. ``detach_backbone``: with a shared head, run the policy backbone without gradients, so a
        value-only update trains the head alone and leaves the policy unchanged. ``padding_free``: as in
        :meth:`token_logprobs` (values at padded response positions are 0).
        """
        T = input_ids.shape[1]
        if not 0 < response_length < T:
            raise ValueError(f"response_length must be in [1, {T - 1}], got {response_length}")
        if padding_free and attention_mask is not None:
            packed, scored, index = self._pack_responses(input_ids, attention_mask, response_length)
            if self.value_head is None:
                values = self._critic_values_at(packed, index)
            else:
                with torch.no_grad() if detach_backbone else nullcontext():
                    hidden = self._decoder(self.model)(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                                       use_cache=False).last_hidden_state
                values = self.value_head(hidden.flatten(0, 1)[index])
            return _spread(scored, values)
        if position_ids is None and attention_mask is not None:
            position_ids = position_ids_from_mask(attention_mask)
        if self.value_head is not None:
            with torch.no_grad() if detach_backbone else nullcontext():
                hidden = scoring_hidden(self._decoder(self.model), input_ids, attention_mask, position_ids,
                                        response_length)
            return self.value_head(hidden)
        return self._values(None, input_ids, attention_mask, position_ids, response_length)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Sample continuations with the transformers generation loop (KV cache). Returns prompt + response ids."""
        kwargs.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        kwargs.setdefault("eos_token_id", self.tokenizer.eos_token_id)
        return self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    # ------------------------------------------------------------------ export
    def merged_model(self, dtype: DType | None = None) -> nn.Module:
        """A plain transformers model with any LoRA adapter merged in; the training model is left untouched."""
        if not self.has_adapter:
            merged = copy.deepcopy(self.model)
        else:
            from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

            # Rebuild an unquantized base and merge into it: merging into 4-/8-bit weights would lose precision.
            base = load_causal_lm(self.spec["model"], **self._load_kwargs)
            fresh = get_peft_model(base, self.lora.to_peft())
            set_peft_model_state_dict(fresh, get_peft_model_state_dict(self.model))
            merged = fresh.merge_and_unload()
        td = torch_dtype(dtype) if dtype else None
        if isinstance(td, torch.dtype):
            merged = merged.to(td)
        return merged

    def save_pretrained(self, output_dir: str | Path, dtype: DType | None = None) -> Path:
        """Write a merged Hugging Face model and tokenizer that ``AutoModelForCausalLM.from_pretrained`` loads."""
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        merged = self.merged_model(dtype)
        merged.config.pad_token_id = self.tokenizer.pad_token_id
        merged.save_pretrained(output_dir, safe_serialization=True)
        self.tokenizer.save_pretrained(output_dir)
        if getattr(merged, "generation_config", None) is not None:
            merged.generation_config.save_pretrained(output_dir)
        return output_dir

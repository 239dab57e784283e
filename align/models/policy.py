"""``PolicyModel``: the one model wrapper shared by SFT, reward modelling, DPO, PPO, TRPO and GRPO.

It loads the causal LM (optionally LoRA / QLoRA) and its tokenizer, generates, and exports. Beside the language
model it holds an optional critic (:mod:`align.models.critic`: a value head on the policy backbone or a backbone
of its own) and the reference (:mod:`align.models.reference`: the policy with its adapter disabled when LoRA is on,
a frozen copy of the initial policy otherwise, or a separately loaded model). Scoring (log-probs, entropies,
values) is :mod:`align.models.scoring`; the methods here delegate to it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from align.errors import AlignConfigError
from align.hub import check_model_source, load_tokenizer
from align.models import scoring
from align.models.critic import Critic, CriticSettings, critic_settings
from align.models.loading import (
    DType,
    LoadKwargs,
    LoraSettings,
    Quantization,
    load_causal_lm,
    torch_dtype,
    trainable,
    zero_dropout,
)
from align.models.reference import AdapterSwitch, build_reference
from align.models.scoring import TokenLogprobs, contiguous_head_input, decoder_of, position_ids_from_mask

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["PolicyModel", "TokenLogprobs", "position_ids_from_mask"]


class PolicyModel(nn.Module):
    def __init__(
        self,
        model: str = "tiny",
        tokenizer: str | None = None,
        dtype: DType = "float32",
        lora: LoraSettings | None = None,
        quantization: Quantization | None = None,
        gradient_checkpointing: bool = False,
        critic: CriticSettings | None = None,
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
            critic: The value model (PPO, TRPO): ``{kind: shared}``, a scalar head on the policy backbone, or
                ``{kind: separate, model: <reward model>}``, a critic with its own backbone (the policy's ``model``
                when unset) whose head starts from a reward model's (``head_from_reward_model``); null: no values.
            reference_model: Load the reference from here instead of using the initial policy.
            attn_implementation: ``sdpa``, ``eager`` or ``flash_attention_2``; null lets transformers choose.
            trust_remote_code: Run model code shipped with a checkpoint. Off unless you trust the source.
            revision: Hub revision (branch, tag or commit) for ``model``.
            pad_equals_eos: Use the EOS token as pad (the tiny tokenizer ships both variants).
            seed: Weight seed of the embedded tiny model (ignored for real models).
        """
        super().__init__()
        try:
            torch_dtype(dtype)
        except AlignConfigError:
            raise AlignConfigError(
                f"model.policy.dtype: expected auto, float32, bfloat16 or float16, got {dtype!r}"
            ) from None
        if quantization not in (None, "4bit", "8bit"):
            raise AlignConfigError(f"model.policy.quantization: expected '4bit', '8bit' or null, got {quantization!r}")
        if quantization is not None and lora is None:
            raise AlignConfigError(
                f"model.policy.quantization: expected null without model.policy.lora (a quantized "
                f"base cannot be trained in full), got {quantization!r}; also set "
                "model.policy.lora"
            )
        critic = critic_settings(critic)
        self.spec: dict[str, Any] = {
            "model": model,
            "tokenizer": tokenizer,
            "dtype": dtype,
            "lora": asdict(lora) if lora else None,
            "quantization": quantization,
            "critic": None,
            "reference_model": reference_model,
            "attn_implementation": attn_implementation,
            "trust_remote_code": trust_remote_code,
            "revision": revision,
            "pad_equals_eos": pad_equals_eos,
            "seed": seed,
        }
        """The settings, saved in checkpoints (``checkpoint["align"]["policy"]``) to rebuild the policy from."""
        self.load_kwargs = LoadKwargs(
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            revision=revision,
            attn_implementation=attn_implementation,
            seed=seed,
        )
        check_model_source(model)  # before the tokenizer, so a bad model path is reported as such
        self.tokenizer = load_tokenizer(
            tokenizer or model, trust_remote_code=trust_remote_code, revision=revision, pad_equals_eos=pad_equals_eos
        )
        base = load_causal_lm(model, quantization=quantization, **self.load_kwargs)
        embeddings = cast(nn.Embedding, base.get_input_embeddings())  # transformers types it as any nn.Module
        if len(self.tokenizer) > embeddings.num_embeddings:
            raise AlignConfigError(
                f"model.policy.tokenizer: expected at most the {embeddings.num_embeddings} tokens of "
                f"the model's embedding, got a tokenizer of {len(self.tokenizer)}; use the model's own tokenizer"
            )
        base.config.pad_token_id = self.tokenizer.pad_token_id
        contiguous_head_input(base)
        self.model = trainable(base, quantization, lora, gradient_checkpointing)
        self.lora = lora
        self.critic: Critic | None = None
        """The value model (:class:`~align.models.critic.Critic`), or None."""
        if critic is not None:
            self.add_critic(critic)
        self.ref_model: nn.Module | None = None
        """The kept reference model (:meth:`setup_reference`); None before, and with LoRA."""
        self._adapter_switch: AdapterSwitch | None = None
        self.train()  # transformers returns models in eval mode; a wrapper built for training starts in train mode

    def add_critic(self, settings: CriticSettings) -> Critic:
        """Build the critic ``settings`` describe and record it in :attr:`spec` (the reward-model module gives a
        policy without one its score head this way)."""
        self.critic = Critic(settings, self.spec["model"], self.config.hidden_size, self.load_kwargs)
        self.spec["critic"] = asdict(settings)
        return self.critic

    def train(self, mode: bool = True) -> PolicyModel:
        super().train(mode)
        if self.ref_model is not None:
            self.ref_model.eval()  # the reference never runs dropout
        return self

    def disable_dropout(self) -> None:
        """Set every dropout of the model, adapter, critic and reference to 0
        (:func:`~align.models.loading.zero_dropout`): the training forward pass then computes the sampler's and the
        reference's log-probs, so an importance ratio is exactly 1 before the first update."""
        zero_dropout(self)

    # ------------------------------------------------------------------ properties
    @property
    def config(self) -> PretrainedConfig:
        return cast("PretrainedConfig", self.model.config)  # the transformers model's (a peft model forwards it)

    @property
    def has_adapter(self) -> bool:
        return self.lora is not None

    @property
    def base_model(self) -> nn.Module:
        """The underlying transformers model (unwrapped from peft)."""
        return cast("PeftModel", self.model).get_base_model() if self.has_adapter else self.model

    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        return (p for p in self.parameters() if p.requires_grad)

    @property
    def adapter_switch(self) -> AdapterSwitch:
        """Switches the LoRA adapter off and on again (:class:`~align.models.reference.AdapterSwitch`)."""
        if self._adapter_switch is None:
            self._adapter_switch = AdapterSwitch(self.model)
        return self._adapter_switch

    # ------------------------------------------------------------------ reference and scoring
    def setup_reference(self) -> None:
        """Make a reference model available to :meth:`token_logprobs` with ``reference=True``. Idempotent.

        With LoRA it is the adapter-disabled policy and nothing is copied; otherwise ``reference_model`` is loaded,
        or a frozen copy of the current (initial) weights is kept (:func:`~align.models.reference.build_reference`).
        """
        if self.ref_model is None:
            self.ref_model = build_reference(self)

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T)
        attention_mask: torch.Tensor | None = None,  # (B, T)
        position_ids: torch.Tensor | None = None,  # (B, T)
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        if position_ids is None and attention_mask is not None:
            position_ids = position_ids_from_mask(attention_mask)
        # Without a cache: transformers only honours packed position ids when no cache is passed.
        kwargs.setdefault("use_cache", False)
        out: CausalLMOutputWithPast = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        )
        return out

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        response_length: int | None = None,
        position_ids: torch.Tensor | None = None,
        temperature: float = 1.0,
        return_entropy: bool = False,
        return_values: bool = False,
        reference: bool = False,
        padding_free: bool = False,
    ) -> TokenLogprobs:
        """Log-probs (and optionally entropy and values) of the last ``response_length`` tokens: see
        :func:`align.models.scoring.token_logprobs`."""
        return scoring.token_logprobs(
            self,
            input_ids,
            attention_mask,
            response_length=response_length,
            position_ids=position_ids,
            temperature=temperature,
            return_entropy=return_entropy,
            return_values=return_values,
            reference=reference,
            padding_free=padding_free,
        )

    def next_token_logprobs(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        ignore_index: int = -100,
        temperature: float = 1.0,
        reference: bool = False,
    ) -> torch.Tensor:
        """``(N,)`` log-probs of ``targets`` at the positions that have one: see
        :func:`align.models.scoring.next_token_logprobs`."""
        return scoring.next_token_logprobs(
            self, input_ids, targets, attention_mask, position_ids, ignore_index, temperature, reference
        )

    def response_logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        response_length: int,
        reference: bool = False,
    ) -> torch.Tensor:
        """``(B, R, V)`` logits predicting the last ``response_length`` tokens: see
        :func:`align.models.scoring.response_logits`."""
        return scoring.response_logits(
            self, input_ids, attention_mask, response_length=response_length, reference=reference
        )

    def values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        response_length: int,
        position_ids: torch.Tensor | None = None,
        detach_backbone: bool = False,
        padding_free: bool = False,
    ) -> torch.Tensor:
        """``(B, R)`` float32 values of the last ``R`` tokens, without the LM head: see
        :meth:`align.models.critic.Critic.values`."""
        if self.critic is None:
            raise RuntimeError("values requested but the policy has no critic; set policy.critic")
        return self.critic.values(
            decoder_of(self.model),
            input_ids,
            attention_mask,
            response_length=response_length,
            position_ids=position_ids,
            detach_backbone=detach_backbone,
            padding_free=padding_free,
        )

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """Sample continuations with the transformers generation loop (KV cache). Returns prompt + response ids."""
        kwargs.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        kwargs.setdefault("eos_token_id", self.tokenizer.eos_token_id)
        lm: Any = self.model  # transformers' or peft's generate, which nn.Module does not declare
        ids: torch.Tensor = lm.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        return ids

    # ------------------------------------------------------------------ export
    def merged_model(self, dtype: DType | str | None = None) -> PreTrainedModel:
        """A plain transformers model with any LoRA adapter merged in; the training model is left untouched."""
        if self.lora is None:  # no adapter: the model is the transformers one
            merged = cast("PreTrainedModel", copy.deepcopy(self.model))
        else:
            from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

            # Rebuild an unquantized base and merge into it: merging into 4-/8-bit weights would lose precision.
            base = load_causal_lm(self.spec["model"], **self.load_kwargs)
            fresh = get_peft_model(base, self.lora.to_peft())
            set_peft_model_state_dict(fresh, get_peft_model_state_dict(self.model))
            merged = cast("PreTrainedModel", fresh.merge_and_unload())  # the base model, the adapter merged in
        td = torch_dtype(dtype) if dtype else None
        if isinstance(td, torch.dtype):
            merged = merged.to(td)  # type: ignore[arg-type]  # transformers' @wraps(nn.Module.to) types it unbound
        return merged

    def save_pretrained(self, output_dir: str | Path, dtype: DType | str | None = None) -> Path:
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

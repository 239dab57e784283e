"""The critic (value model) of a :class:`~align.models.policy.PolicyModel`: ``V(state before token j)`` per token.

Two kinds (:class:`CriticSettings`, the policy's ``critic:`` block):

* ``shared``: a zero-initialised scalar head on the policy's own backbone. Its values come from the policy's hidden
  states (the scoring pass computes them anyway), and its gradients reach the backbone;
* ``separate``: a backbone of its own (by default a copy of the policy model; often a trained reward model) with
  the head. When that backbone is a reward model, the head starts from its reward head, so the critic starts by
  predicting the reward model's score of each prefix instead of 0.

A reward model trained by align is a policy with a shared critic: the head is its scalar score head.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from align.core.packing import PackedRows
from align.errors import AlignConfigError
from align.hub import check_model_source
from align.models.loading import LoadKwargs, load_decoder, reward_head_state
from align.models.scoring import pack_responses, position_ids_from_mask, spread
from align.models.shared_pass import scoring_hidden

CriticKind = Literal["shared", "separate"]


@dataclass(frozen=True)
class CriticSettings:
    """The policy's value model (``model.policy.critic``), for PPO and TRPO (and the score head of a reward model)."""

    kind: CriticKind = "shared"
    """``shared``: a scalar head on the policy backbone; ``separate``: a critic with a backbone of its own."""
    model: str | None = None
    """Backbone of a ``separate`` critic (for example a trained reward model: an export directory, a reward-model
    checkpoint or ``tiny-sort-rm``); null: the policy's ``model``."""
    head_from_reward_model: bool = True
    """When the separate critic's backbone is a reward model (anything
    :func:`~align.models.reward_export.load_reward_model` loads), start the critic's head from its reward head instead
    of at 0."""

    def __post_init__(self) -> None:
        if self.kind not in ("shared", "separate"):
            raise AlignConfigError(f"model.policy.critic.kind: expected 'shared' or 'separate', got {self.kind!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise AlignConfigError(f"model.policy.critic.model: expected a model path or id, got {self.model!r}")
        if self.model is not None and self.kind == "shared":
            raise AlignConfigError(
                f"model.policy.critic.model: expected null for a shared critic (a head on the "
                f"policy's backbone), got {self.model!r}; set model.policy.critic.kind: separate "
                "to give the critic a backbone of its own"
            )
        if not isinstance(self.head_from_reward_model, bool):
            raise AlignConfigError(
                f"model.policy.critic.head_from_reward_model: expected true or false, got "
                f"{self.head_from_reward_model!r}"
            )


def critic_settings(value: CriticSettings | dict[str, Any] | None) -> CriticSettings | None:
    """``value`` as :class:`CriticSettings`: a settings object, the dict of a saved spec, or None."""
    if value is None or isinstance(value, CriticSettings):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"kind", "model", "head_from_reward_model"})
        if unknown:
            raise AlignConfigError(
                f"model.policy.critic.{unknown[0]}: not a setting of the critic; expected kind, "
                "model or head_from_reward_model"
            )
        return CriticSettings(**value)
    raise AlignConfigError(
        f"model.policy.critic: expected a block such as {{kind: shared}} or {{kind: separate, "
        f"model: <reward model>}}, or null, got {value!r}"
    )


class ValueHead(nn.Module):
    """A scalar per token on top of final hidden states (zero-initialised: the critic starts at V = 0)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores: torch.Tensor = self.proj(hidden.to(self.proj.weight.dtype))  # (..., 1)
        return scores.squeeze(-1).float()


class Critic(nn.Module):
    """The value model: ``head`` (a :class:`ValueHead`) on the policy's backbone (shared) or on ``backbone``
    (separate). Its parameters are the value parameters an optimizer trains (the policy backbone is not among
    them)."""

    def __init__(self, settings: CriticSettings, policy_model: str, hidden_size: int, load_kwargs: LoadKwargs):
        """``policy_model``: the policy's model (a separate critic's default backbone); ``hidden_size``: the
        policy's; ``load_kwargs``: how the policy was loaded (dtype, revision, ...)."""
        super().__init__()
        self.settings = settings
        self.source = settings.model or policy_model
        self.backbone: nn.Module | None = None
        if settings.kind == "separate":
            check_model_source(self.source, what="model.policy.critic.model")
            backbone = load_decoder(self.source, **load_kwargs)
            hidden_size = backbone.config.hidden_size
            self.backbone = backbone
        self.head = ValueHead(hidden_size)
        if self.separate and settings.head_from_reward_model:
            self.init_head_from_reward_model()

    @property
    def separate(self) -> bool:
        """Whether the critic has a backbone of its own."""
        return self.settings.kind == "separate"

    def init_head_from_reward_model(self) -> bool:
        """Load the reward head of the separate critic's backbone into ``head`` when that backbone is a reward
        model. Returns whether it did."""
        if not self.separate:
            return False
        state = reward_head_state(self.source)
        if state is None:
            return False
        self.head.load_state_dict({k: v.to(self.head.proj.weight.dtype) for k, v in state.items()})
        return True

    def padded_values(
        self,
        input_ids: torch.Tensor,  # (B, T)
        attention_mask: torch.Tensor | None,  # (B, T)
        position_ids: torch.Tensor | None,  # (B, T)
        R: int,
    ) -> torch.Tensor:
        """``(B, R)`` values of the last ``R`` tokens of padded rows by the separate critic's own pass
        (:func:`~align.models.shared_pass.scoring_hidden`)."""
        assert self.backbone is not None, "padded_values: only a separate critic has a backbone of its own"
        values: torch.Tensor = self.head(scoring_hidden(self.backbone, input_ids, attention_mask, position_ids, R))
        return values

    def packed_values(self, packed: PackedRows, index: torch.Tensor) -> torch.Tensor:
        """``(N,)`` values of the separate critic at the flattened positions ``index`` of ``packed``'s rows."""
        assert self.backbone is not None, "packed_values: only a separate critic has a backbone of its own"
        hidden = self.backbone(
            input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False
        ).last_hidden_state
        values: torch.Tensor = self.head(hidden.flatten(0, 1)[index])  # (N,)
        return values

    def values(
        self,
        decoder: nn.Module,
        input_ids: torch.Tensor,  # (B, T)
        attention_mask: torch.Tensor | None = None,  # (B, T)
        *,
        response_length: int,
        position_ids: torch.Tensor | None = None,
        detach_backbone: bool = False,
        padding_free: bool = False,
    ) -> torch.Tensor:
        """``(B, R)`` float32 values ``V(state before token j)`` of the last ``R`` tokens, without the LM head.

        ``decoder``: the policy's decoder, which a shared head reads. The same numbers as
        ``token_logprobs(..., return_values=True).values``; for a value-only update or a rollout.
        ``detach_backbone``: with a shared head, run the policy backbone without gradients, so a value-only update
        trains the head alone and leaves the policy unchanged. ``padding_free``: as in
        :func:`~align.models.scoring.token_logprobs` (values at padded response positions are 0).
        """
        T = input_ids.shape[1]
        if not 0 < response_length < T:
            raise ValueError(f"response_length must be in [1, {T - 1}], got {response_length}")
        if padding_free and attention_mask is not None:
            packed, scored, index = pack_responses(input_ids, attention_mask, response_length)
            if self.separate:
                values = self.packed_values(packed, index)
            else:
                with torch.no_grad() if detach_backbone else nullcontext():
                    hidden = decoder(
                        input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False
                    ).last_hidden_state
                values = self.head(hidden.flatten(0, 1)[index])
            return spread(scored, values)
        if position_ids is None and attention_mask is not None:
            position_ids = position_ids_from_mask(attention_mask)
        if self.separate:
            return self.padded_values(input_ids, attention_mask, position_ids, response_length)
        with torch.no_grad() if detach_backbone else nullcontext():
            hidden = scoring_hidden(decoder, input_ids, attention_mask, position_ids, response_length)
        shared: torch.Tensor = self.head(hidden)  # (B, R)
        return shared

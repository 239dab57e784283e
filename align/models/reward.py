"""The reward model: a decoder and a scalar head, scored at each sequence's last token.

A reward model is trained as a :class:`~align.models.policy.PolicyModel` with a shared critic (``critic: {kind:
shared}``): the causal LM's decoder (LoRA / QLoRA and every loading option of the policy wrapper apply) and the
critic's scalar linear head, read at the last real token of each sequence (:func:`sequence_scores`). The LM head
is never run. :class:`RewardModel` holds what scoring needs whatever the source (a policy, or a loaded
``*ForSequenceClassification``); the export format and its loading are in :mod:`align.models.reward_export`, the
reward callable that encodes text and scores it is :class:`align.rollout.rewards.RewardModelScorer`.

Where the score is read (:func:`last_scored_index`). align reads the last real token of the attention mask, which
is the response's EOS. transformers' sequence classifiers take the rightmost token that is not
``config.pad_token_id``; when ``pad == eos`` (SmolLM2, many chat models) the two differ: transformers skips a final
EOS as if it were padding, and so cannot tell a finished answer from one cut off at the same token. align's export
therefore names a pad token that is not the EOS (:func:`align.models.reward_export.scoring_pad_token`), so the two
rules pick the same token. Scoring a loaded sequence classifier (a peer's included), align reads the score where
transformers does: the last real token that is not the model's pad id (``skip_token_id``). For align's exports
that is the mask's last token; for a model trained by TRL with ``pad == eos`` it is the token before the final
EOS, as in its training.

The head's bias: a sequence classifier's ``score`` has none. Bradley-Terry training cannot move a constant
offset, so :class:`~align.modules.reward.RewardModule` keeps the bias frozen at 0 (:func:`init_reward_head`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from align.core.masks import last_valid_index
from align.core.packing import pack_scored_rows
from align.errors import AlignConfigError
from align.models.critic import ValueHead
from align.models.policy import PolicyModel
from align.models.scoring import decoder_of, position_ids_from_mask

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def last_scored_index(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, skip_token_id: int | None = None
) -> torch.Tensor:
    """``(N,)`` index of the token a sequence's score is read at: the last real token (attention mask) that is
    not ``skip_token_id``. With ``skip_token_id`` = a model's ``config.pad_token_id`` this is the token
    transformers' ``*ForSequenceClassification`` pools on real-token inputs; a row made only of that token
    falls back to its last real token."""
    real = attention_mask.bool()  # (N, T)
    last = last_valid_index(real)
    if skip_token_id is not None:
        kept = last_valid_index(real & (input_ids != skip_token_id))
        last = torch.where(kept >= 0, kept, last)
    if bool((last < 0).any()):
        raise ValueError("sequence_scores: a row has no real token")
    return last


def pooled_scores(
    decoder: nn.Module,
    head: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    skip_token_id: int | None = None,
    padding_free: bool = False,
) -> torch.Tensor:
    """Run ``decoder`` and ``head`` at each row's scored token (:func:`last_scored_index`). ``(N, T) -> (N,)``.

    Padding may sit on either side: positions come from the mask. ``padding_free`` runs the decoder over the rows'
    real tokens laid end to end (:func:`align.core.packing.pack_scored_rows`) instead of the padded rows: the same
    scores to float rounding, without the arithmetic of the padding.
    """
    last = last_scored_index(input_ids, attention_mask, skip_token_id)  # (N,)
    if padding_free:
        packed = pack_scored_rows(input_ids, attention_mask, torch.zeros_like(attention_mask))
        hidden = decoder(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,  # (K, C, H)
            use_cache=False,
        ).last_hidden_state
        scores: torch.Tensor = head(hidden.reshape(-1, hidden.shape[-1])[packed.locate(last)])  # (N,)
        return scores
    hidden = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,  # (N, T, H)
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state
    scores = head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])  # (N,)
    return scores


def score_head(policy: PolicyModel, what: str = "reward model") -> ValueHead:
    """The reward model's scalar head: the head of ``policy``'s shared critic."""
    if policy.critic is None or policy.critic.separate:
        raise AlignConfigError(f"{what}: the policy needs a shared critic (critic: {{kind: shared}}, the scalar head)")
    return policy.critic.head


def sequence_scores(
    policy: PolicyModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, padding_free: bool = False
) -> torch.Tensor:
    """Scalar score of each sequence, read at its last real token. ``(N, T) -> (N,)`` float32.

    Only the decoder and the head run; ``padding_free`` as in :func:`pooled_scores`.
    """
    return pooled_scores(
        decoder_of(policy.model), score_head(policy), input_ids, attention_mask, padding_free=padding_free
    )


class ScalarHead(nn.Module):
    """A sequence classifier's ``score`` layer (``Linear(H, 1)``) as a head giving ``(..., H) -> (...)`` float32."""

    def __init__(self, score: nn.Linear):
        super().__init__()
        self.score = score

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores: torch.Tensor = self.score(hidden.to(self.score.weight.dtype))  # (..., 1)
        return scores.squeeze(-1).float()


class RewardModel(nn.Module):
    """What scoring needs, whatever the source: a decoder, a scalar head, the tokenizer and the pooling rule.

    ``skip_token_id``: the pad id a sequence classifier skips when it pools (see the module docstring);
    None for a model trained by align from a checkpoint, which reads the mask's last token.
    """

    def __init__(
        self, decoder: nn.Module, head: nn.Module, tokenizer: PreTrainedTokenizerBase, skip_token_id: int | None = None
    ) -> None:
        super().__init__()
        self.decoder, self.head = decoder, head
        self.tokenizer = tokenizer
        self.skip_token_id = skip_token_id

    @classmethod
    def from_policy(cls, policy: PolicyModel) -> RewardModel:
        return cls(decoder_of(policy.model), score_head(policy), policy.tokenizer)

    @classmethod
    def from_sequence_classifier(cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> RewardModel:
        return cls(
            getattr(model, model.base_model_prefix),
            ScalarHead(cast(nn.Linear, model.score)),  # a sequence classifier's linear score layer
            tokenizer,
            model.config.get_text_config().pad_token_id,
        )

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return pooled_scores(self.decoder, self.head, input_ids, attention_mask, self.skip_token_id)


def init_reward_head(policy: PolicyModel, generator: torch.Generator | None = None) -> None:
    """Small random head weights, so an untrained model ranks pairs at chance instead of tying every pair at 0."""
    head = score_head(policy).proj
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / (head.in_features + 1) ** 0.5, generator=generator)
        head.bias.zero_()

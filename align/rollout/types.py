"""What flows out of the rollout layer: a :class:`Rollout` (sampled rows with their log-probs) and a :class:`Scored`
rollout (with its rewards)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

__all__ = ["Rollout", "Scored", "rollout_from_state", "rollout_state", "rollout_to"]


@dataclass
class Rollout:
    """Sampled completions of a batch of prompts. ``N = num_prompts * group_size`` rows; ``P`` the padded
    prompt width; ``R`` the padded response width. Row ``i`` answers prompt ``prompt_index[i]``; the
    ``group_size`` completions of a prompt are consecutive rows.

    A multi-turn rollout (:func:`align.rollout.episodes.play_episodes`) keeps the same layout: the "response" of a row
    is everything after its first prompt, the policy's turns and the environment's replies in between.
    ``response_mask`` then covers the policy's tokens only (each turn through its stop token), ``context_mask``
    every token of the conversation, ``token_rewards`` holds the environment's reward of each turn at that
    turn's last token, and ``episodes`` what else happened (one plain dict per row: ``messages``, ``turns``,
    ``end``, ``env_reward``, ``info``, ``completion_ids`` of the last turn, and ``calls``, the timed
    environment calls). ``texts`` are the last assistant turns. A single-turn rollout leaves the three None.

    An engine whose log-probs are not the trainer's (vLLM) leaves its own in ``engine_logprobs`` once the sampler
    has recomputed the trainer's into ``old_logprobs`` (:meth:`align.rollout.sampler.Sampler.correct`), and
    ``correction_weights`` holds each token's importance weight for the update (:mod:`align.core.mismatch`).

    ``policy_version`` names the policy that sampled the rows: the number of optimizer steps it had taken. A source
    that runs ahead of training produces rows of an older version than the one being updated; the update's
    importance ratio then takes the sampling log-probs (``old_logprobs``) as the behaviour policy. A row cut by a
    weight update and continued under the new weights (:mod:`align.rollout.partial`) has tokens of several versions:
    ``token_versions`` holds each token's, and ``policy_version`` is then the oldest.
    """

    prompt_ids: torch.Tensor  # (N, P) long, left-padded
    prompt_mask: torch.Tensor  # (N, P) long, 1 on real prompt tokens
    response_ids: torch.Tensor  # (N, R) long, pad after the first stop token
    response_mask: torch.Tensor  # (N, R) bool, up to and including the first stop token
    old_logprobs: torch.Tensor  # (N, R) float32, sampling log-probs (0 where masked)
    truncated: torch.Tensor  # (N,) bool, no stop token within max_new_tokens
    texts: list[str]  # N decoded responses (special tokens skipped)
    prompt_index: torch.Tensor  # (N,) long, index of the prompt in the input list (the group id)
    group_size: int
    generation_seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    context_mask: torch.Tensor | None = None  # (N, R) long, 1 on every response-side token (multi-turn)
    token_rewards: torch.Tensor | None = None  # (N, R) float32, environment rewards at turn ends (multi-turn)
    episodes: list[dict] | None = None  # N plain dicts (multi-turn)
    policy_version: int = 0  # optimizer steps the sampling policy had taken (the oldest, for joined rollouts)
    engine_logprobs: torch.Tensor | None = None  # (N, R) float32, the engine's own log-probs (0 where masked)
    correction_weights: torch.Tensor | None = None  # (N, R) float32, detached importance weights (0 where masked)
    token_versions: torch.Tensor | None = None  # (N, R) long, the policy version of each token (partial rollouts)

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        """``(N, P + R)`` prompt followed by response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """``(N, P + R)``: the prompt mask followed by the response mask (every conversation token, multi-turn)."""
        context = self.response_mask.long() if self.context_mask is None else self.context_mask
        return torch.cat([self.prompt_mask, context], dim=1)

    @property
    def response_lengths(self) -> torch.Tensor:
        """``(N,)`` valid response tokens per row (the policy's tokens of every turn, multi-turn)."""
        return self.response_mask.sum(dim=1)


def rollout_state(rollout: Rollout) -> dict:
    """``rollout`` as plain containers with its tensors on the CPU: what a checkpoint loaded with ``weights_only``
    holds (:func:`rollout_from_state` reads it back)."""
    return {
        f.name: (value.cpu() if isinstance(value := getattr(rollout, f.name), torch.Tensor) else value)
        for f in fields(rollout)
    }


def rollout_from_state(state: dict, device: torch.device | str | None = None) -> Rollout:
    """The :class:`Rollout` of :func:`rollout_state`, its tensors moved to ``device`` (None: left where they are)."""
    rollout = Rollout(**state)
    return rollout if device is None else rollout_to(rollout, device)


def rollout_to(rollout: Rollout, device: torch.device | str) -> Rollout:
    """``rollout`` with every tensor on ``device`` (the same object when they are there already)."""
    changes: dict[str, Any] = {
        f.name: value.to(device)
        for f in fields(rollout)
        if isinstance(value := getattr(rollout, f.name), torch.Tensor) and value.device != torch.device(device)
    }
    return replace(rollout, **changes) if changes else rollout


@dataclass
class Scored:
    """A rollout to update on: its rows, each row's total training ``rewards`` (N,), each reward part ``parts``
    ``{name: (N,)}``, and the seconds spent on it (``timings``: ``time/generation_s``, ``time/scoring_s``; summed over
    every batch sampled for it when a source fills an update from several)."""

    rollout: Rollout
    rewards: torch.Tensor
    parts: dict[str, torch.Tensor]
    timings: dict[str, float] = field(default_factory=dict)

"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2) as a rollout-filling policy.

A group whose rewards all match has zero advantage and gives no gradient; it only dilutes the batch. The
paper over-samples and keeps sampling until the batch holds ``B`` groups with ``0 < correct < G``. Here one
Lightning training step samples one prompt batch, so the fill runs across training steps:
:meth:`GroupFilter.add` keeps the informative groups of each scored rollout and answers ``None`` (no update on
this step) until ``target`` groups are buffered on every rank; it then returns exactly ``target`` groups per
rank as one :class:`~align.rollout.types.Rollout` (the excess is dropped, as in the paper) and clears the buffer.

Departures: after ``max_batches`` sampled batches without a full buffer the update uses what it has (the paper
keeps sampling); with nothing buffered the batches are dropped and no update is taken. Under data parallelism
every rank trains on the same number of groups (the smallest count of any rank, at most ``target``), so every
rank takes the same optimizer steps with the same micro-batches; the counts are shared with one all-reduce.

No optimizer step runs while the buffer fills, so the policy that sampled every buffered group is the one
being updated: the buffered log-probs stay the old policy's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from align.core.advantages import SIGNAL_EPS, has_signal
from align.rollout.types import Rollout, rollout_from_state, rollout_state

__all__ = ["GroupFilter", "Filled", "informative_groups", "select_groups", "concat_rollouts"]

log = logging.getLogger(__name__)


def informative_groups(values: torch.Tensor, group_size: int, eps: float = SIGNAL_EPS) -> torch.Tensor:
    """``(N,) -> (N / group_size,)`` bool: whether a group of consecutive rows carries a learning signal, by the
    test GRPO's advantages use (:func:`align.core.advantages.has_signal`): a group kept here gets a non-zero
    advantage, a group dropped here would get exactly zero."""
    return has_signal(values, group_size, eps)


def select_groups(rollout: Rollout, groups: torch.Tensor) -> Rollout:
    """The rows of the groups ``groups`` (indices of prompts), renumbered ``0..len(groups)-1``."""
    g = rollout.group_size
    device = rollout.prompt_index.device
    rows = (groups.to(device)[:, None] * g + torch.arange(g, device=device)).flatten()
    out: dict[str, Any] = {}
    for f in fields(Rollout):
        value = getattr(rollout, f.name)
        if isinstance(value, torch.Tensor):
            value = value[rows.to(value.device)]
        elif isinstance(value, list):
            value = [value[i] for i in rows.tolist()]
        out[f.name] = value
    out["prompt_index"] = torch.arange(len(groups), device=device).repeat_interleave(g)
    out["metrics"] = dict(rollout.metrics)
    return Rollout(**out)


def _pad_to(t: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    extra = width - t.shape[1]
    if extra == 0:
        return t
    pad = t.new_full((t.shape[0], extra), value)
    return torch.cat([pad, t] if left else [t, pad], dim=1)


_RIGHT_PADDED = {
    "response_ids": None,
    "response_mask": False,
    "old_logprobs": 0.0,
    "context_mask": 0,
    "token_rewards": 0.0,
    "engine_logprobs": 0.0,
    "correction_weights": 0.0,
}
"""Per-token fields of a rollout padded on the right when rollouts are joined, and their fill (None: the pad id)."""


def concat_rollouts(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """One rollout of the rows of ``rollouts`` (same group size): prompts re-padded on the left, responses on
    the right, groups renumbered in order. ``generation_seconds`` is the sum; ``metrics`` are left empty."""
    if len(rollouts) == 1:
        return rollouts[0]
    p = max(r.prompt_ids.shape[1] for r in rollouts)
    w = max(r.response_ids.shape[1] for r in rollouts)
    out: dict[str, Any] = {}
    for f in fields(Rollout):
        values = [getattr(r, f.name) for r in rollouts]
        if values[0] is None:
            out[f.name] = None
        elif f.name in ("prompt_ids", "prompt_mask"):
            out[f.name] = torch.cat(
                [_pad_to(v, p, pad_token_id if f.name == "prompt_ids" else 0, True) for v in values]
            )
        elif f.name in _RIGHT_PADDED:
            fill = _RIGHT_PADDED[f.name]
            out[f.name] = torch.cat([_pad_to(v, w, pad_token_id if fill is None else fill, False) for v in values])
        elif isinstance(values[0], torch.Tensor):
            out[f.name] = torch.cat(values)
        elif isinstance(values[0], list):
            out[f.name] = [x for v in values for x in v]
    offsets, index = 0, []
    for r in rollouts:
        index.append(r.prompt_index + offsets)
        offsets += len(r) // r.group_size
    out.update(
        prompt_index=torch.cat(index),
        group_size=rollouts[0].group_size,
        metrics={},
        generation_seconds=sum(r.generation_seconds for r in rollouts),
    )
    return Rollout(**out)


@dataclass
class Filled:
    """What an update trains on: ``rollout`` (``target`` groups or fewer at the cap), its ``rewards`` (N,) and
    reward ``parts`` {name: (N,)}. ``rollout.metrics`` holds the fill's metrics (:class:`GroupFilter`)."""

    rollout: Rollout
    rewards: torch.Tensor
    parts: dict[str, torch.Tensor]


@dataclass
class GroupFilter:
    """Buffers the informative groups of each scored rollout until an update has ``target`` of them.

    Metrics set on the returned rollout: ``rollout/sampling_batches`` (prompt batches sampled for this update),
    ``rollout/kept_groups`` (groups trained on, per rank), ``rollout/kept_frac`` (informative share of all
    sampled groups), ``rollout/completion_tokens`` and ``rollout/tokens_per_s`` (over every sampled batch,
    dropped groups included), ``rollout/response_length`` and ``rollout/truncated_frac`` (over the rows trained
    on). Reward metrics computed from the returned rewards are therefore over the groups trained on.
    """

    group_size: int
    max_batches: int = 4
    reward: str | None = None  # the reward part whose values must differ; None: the total
    eps: float = SIGNAL_EPS
    batches: int = 0
    sampled_groups: int = 0
    sampled_tokens: float = 0.0
    generation_seconds: float = 0.0
    target: int = 0
    buffer: list[Filled] = field(default_factory=list)

    @property
    def filling(self) -> bool:
        """Whether batches were sampled since the last update (the next step adds to them)."""
        return self.batches > 0

    @property
    def buffered_groups(self) -> int:
        return sum(len(f.rollout) // self.group_size for f in self.buffer)

    def add(
        self,
        rollout: Rollout,
        rewards: torch.Tensor,
        parts: dict[str, torch.Tensor],
        target: int,
        pad_token_id: int,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
        rank: int = 0,
        world: int = 1,
    ) -> Filled | None:
        """Buffer the informative groups of ``rollout``; the update's data once ``target`` groups per rank are
        buffered on every rank (or at the cap), else ``None``. ``target`` (prompts per rank) is taken from the
        first batch of a fill. ``all_reduce`` sums over ranks; every rank must call this on every step."""
        if not self.filling:
            self.target = target
        self.batches += 1
        self.sampled_groups += len(rollout) // self.group_size
        self.sampled_tokens += float(rollout.response_lengths.sum())
        self.generation_seconds += rollout.generation_seconds
        keep = informative_groups(parts[self.reward] if self.reward else rewards, self.group_size, self.eps)
        groups = keep.nonzero().flatten()
        if len(groups):
            rows = (groups[:, None] * self.group_size + torch.arange(self.group_size, device=groups.device)).flatten()
            self.buffer.append(
                Filled(select_groups(rollout, groups), rewards[rows], {k: v[rows] for k, v in parts.items()})
            )
        counts = torch.zeros(world + 1, device=rewards.device)
        counts[rank] = self.buffered_groups
        counts[world] = float(self.sampled_groups)
        counts = all_reduce(counts)  # every rank's buffered groups and the sampled groups of all ranks
        take = min(int(counts[:world].min()), self.target)
        if take < self.target and self.batches < self.max_batches:
            return None
        metrics = {
            "rollout/sampling_batches": float(self.batches),
            "rollout/kept_groups": float(take),
            "rollout/kept_frac": float(counts[:world].sum() / counts[world].clamp(min=1)),
            "rollout/completion_tokens": self.sampled_tokens,
            "rollout/tokens_per_s": self.sampled_tokens / max(self.generation_seconds, 1e-9),
        }
        buffer, batches = self.buffer, self.batches
        self.clear()
        if take == 0:
            log.warning(
                "dynamic sampling: after %d sampled batches a rank has no group whose rewards differ; "
                "no update (max_batches reached)",
                batches,
            )
            return None
        out = Filled(
            concat_rollouts([f.rollout for f in buffer], pad_token_id),
            torch.cat([f.rewards for f in buffer]),
            {k: torch.cat([f.parts[k] for f in buffer]) for k in buffer[0].parts},
        )
        if len(out.rollout) > take * self.group_size:  # the excess groups are dropped, as in the paper
            kept = slice(0, take * self.group_size)
            out = Filled(
                select_groups(out.rollout, torch.arange(take)),
                out.rewards[kept],
                {k: v[kept] for k, v in out.parts.items()},
            )
        lengths = out.rollout.response_lengths.float()
        metrics["rollout/response_length"] = float(lengths.mean())
        metrics["rollout/truncated_frac"] = float(out.rollout.truncated.float().mean())
        out.rollout.metrics = metrics
        return out

    def clear(self) -> None:
        self.buffer, self.batches, self.sampled_groups = [], 0, 0
        self.sampled_tokens = self.generation_seconds = 0.0

    _COUNTERS = ("batches", "sampled_groups", "sampled_tokens", "generation_seconds", "target")

    def state_dict(self) -> dict[str, Any]:
        """The fill in progress (counters and buffered groups) as plain containers and CPU tensors, so a
        checkpoint written between updates resumes it."""

        def cpu(t):
            return t.cpu() if isinstance(t, torch.Tensor) else t

        return {
            **{k: getattr(self, k) for k in self._COUNTERS},
            "buffer": [
                {
                    "rollout": rollout_state(f.rollout),
                    "rewards": cpu(f.rewards),
                    "parts": {k: cpu(v) for k, v in f.parts.items()},
                }
                for f in self.buffer
            ],
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str | None = None) -> None:
        def move(t):
            return t.to(device) if isinstance(t, torch.Tensor) and device is not None else t

        for k in self._COUNTERS:
            setattr(self, k, state[k])
        self.buffer = [
            Filled(
                rollout_from_state(f["rollout"], device),
                move(f["rewards"]),
                {k: move(v) for k, v in f["parts"].items()},
            )
            for f in state["buffer"]
        ]

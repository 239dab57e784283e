"""Rollout sources: where an RL module's training rollouts come from.

A module pulls from its source once per training step, the way a trainer pulls batches from a data loader:
``source.next(batch, version)`` turns a batch of prompts into a :class:`~align.rollout.types.Scored` rollout to update
on, or ``None`` when this step yields nothing to update on (the module then takes no optimizer step). The source owns
the policy of *when* and *how much* to sample; the :class:`~align.rollout.sampler.Sampler` it is bound to does the
sampling and scoring. Each source is chosen in YAML with ``model.source`` (a ``class_path`` and its ``init_args``):

* :class:`InlineSource` (the default): one rollout of the step's prompts, sampled now by the current policy.
* :class:`FilteredSource`: DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476): groups whose rewards all
  match are dropped and prompt batches are sampled on the following steps until an update has a full batch of
  informative groups (:class:`~align.rollout.filter.GroupFilter`).

A new source (docs/architecture.md, "Add a rollout source") subclasses :class:`RolloutSource`: for example one that
runs ahead of training returns rollouts of an older ``policy_version`` than the one being updated. A source whose
work in progress must survive a restart returns it from :meth:`~RolloutSource.state_dict`; the module saves it in its
checkpoints for every rank.
"""

from __future__ import annotations

import logging
from typing import Any

from align.errors import AlignConfigError
from align.rollout.filter import GroupFilter
from align.rollout.sampler import Sampler
from align.rollout.types import Scored

__all__ = ["RolloutSource", "InlineSource", "FilteredSource"]

log = logging.getLogger(__name__)


class RolloutSource:
    """Base of the rollout sources: bound to a sampler by the module (:meth:`bind`), then asked for one scored
    rollout per training step (:meth:`next`)."""

    sampler: Sampler
    no_update_reason = "the rollout source yielded no rollout to update on"
    """What the module's stop after too many steps without an update names as missing (:meth:`next` gave None)."""

    def bind(self, sampler: Sampler) -> None:
        """Sample with ``sampler``; checks that this source can serve it (raises :class:`AlignConfigError`)."""
        self.sampler = sampler

    def next(self, batch, version: int) -> Scored | None:
        """A scored rollout to update on for the step with prompts ``batch`` while the policy being trained is at
        ``version`` (its optimizer steps), or None: no update on this step."""
        raise NotImplementedError

    @property
    def pending(self) -> bool:
        """Whether rollouts sampled on earlier steps wait for the next update (a filtered source filling up)."""
        return False

    @property
    def max_steps_without_update(self) -> int:
        """How many training steps in a row this source may yield nothing by design (0: every step yields)."""
        return 0

    def state_dict(self) -> dict[str, Any]:
        """Work in progress that a checkpoint must keep (plain containers and CPU tensors); empty: nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any], device=None) -> None:
        """Continue the work of :meth:`state_dict` on ``device``."""

    def close(self) -> None:
        """Release what the source holds (worker processes, engines) at the end of training."""


class InlineSource(RolloutSource):
    """One rollout of the step's prompts, sampled now by the policy being trained (synchronous RL)."""

    def next(self, batch, version: int) -> Scored:
        return self.sampler.sample(batch, version)


class FilteredSource(RolloutSource):
    """DAPO's dynamic sampling: keep the groups whose rewards differ and sample further prompt batches (one per
    training step, at most ``max_batches`` per update) until the update has as many groups as a batch has prompts.

    Departures from the paper: at the cap the update uses the groups it has (the paper keeps sampling); under data
    parallelism every rank trains on the same number of groups (see :class:`~align.rollout.filter.GroupFilter`).
    No optimizer step runs while the buffer fills, so the policy that sampled every buffered group is the one
    being updated. Needs ``group_size >= 2``.

    Metrics, logged once per update: ``rollout/sampling_batches``, ``rollout/kept_groups``, ``rollout/kept_frac``;
    the reward metrics are then over the groups trained on, the timings summed over the batches sampled for it.
    """

    no_update_reason = "dynamic sampling: no update could be filled with groups whose rewards differ"

    def __init__(self, max_batches: int = 4, reward: str | None = None):
        """
        Args:
            max_batches: Cap on the prompt batches sampled for one update; at the cap the update uses the groups it
                has, and is skipped when it has none.
            reward: Reward whose values must differ within a group (e.g. the accuracy reward, as in the paper); null:
                the training total.
        """
        if max_batches < 1:
            raise AlignConfigError(f"model.source.max_batches: expected >= 1, got {max_batches}")
        self.max_batches, self.reward = max_batches, reward
        self.filter: GroupFilter | None = None
        self._timings: dict[str, float] = {}

    def bind(self, sampler: Sampler) -> None:
        super().bind(sampler)
        if sampler.group_size < 2:
            raise AlignConfigError(
                f"model.source: FilteredSource keeps the groups whose rewards differ, so it needs "
                f"model.group_size >= 2, got {sampler.group_size}"
            )
        names = sampler.reward.names + (["overlong"] if sampler.overlong is not None else [])
        if self.reward is not None and self.reward not in names:
            raise AlignConfigError(
                f"model.source.reward: expected one of the rewards {names} or null, got {self.reward!r}"
            )
        self.filter = GroupFilter(sampler.group_size, self.max_batches, self.reward)

    @property
    def pending(self) -> bool:
        return self.filter is not None and self.filter.filling

    @property
    def max_steps_without_update(self) -> int:
        return 2 * self.max_batches

    def next(self, batch, version: int) -> Scored | None:
        if not self.pending:
            self._timings = {}
        scored = self.sampler.sample(batch, version)
        for key, seconds in scored.timings.items():
            self._timings[key] = self._timings.get(key, 0.0) + seconds
        ranks = self.sampler.ranks()
        assert self.filter is not None  # made by bind(), which the module calls before any step
        filled = self.filter.add(
            scored.rollout,
            scored.rewards,
            scored.parts,
            len(batch),
            self.sampler.policy.tokenizer.pad_token_id,
            ranks.all_reduce,
            ranks.rank,
            ranks.size,
        )
        if filled is None:
            return None
        return Scored(filled.rollout, filled.rewards, filled.parts, self._timings)

    def state_dict(self) -> dict[str, Any]:
        return self.filter.state_dict() if self.filter is not None else {}

    def load_state_dict(self, state: dict[str, Any], device=None) -> None:
        if state:
            assert self.filter is not None  # made by bind(), which the module calls before loading a checkpoint
            self.filter.load_state_dict(state, device)

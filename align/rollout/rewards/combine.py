"""Several rewards as one: :class:`CombinedReward` weighs them (evaluated together,
:mod:`align.rollout.rewards.concurrent`), and :func:`training_rewards` builds an RL run's list (the reward model, the
rewards, the eval-only rewards).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from align.data.prompts import REWARD_INPUTS
from align.errors import AlignConfigError
from align.rollout.rewards.concurrent import RewardCounts, evaluate
from align.rollout.rewards.function import RewardFunction, RewardSpec
from align.rollout.rewards.resolve import RewardFn
from align.rollout.rewards.reward_model import LazyRewardModel, RewardModelSpec


class CombinedReward:
    """The weighted sum of several rewards, with each one's values kept for metrics.

    The rewards of a batch are evaluated together (:func:`align.rollout.rewards.concurrent.evaluate`). A reward that
    returns None for a row does not apply to it: the row's total is the weighted sum of the rewards that do apply,
    not renormalised over them, and the reward's part holds 0 there (what it adds to the total); :attr:`last_counts`
    counts such rows, and the rows a judge or remote reward scored by default."""

    def __init__(
        self,
        rewards: Sequence[RewardFunction | RewardSpec | str | RewardFn],
        allow_empty: bool = False,
        where: str = "rewards",
    ):
        """``allow_empty``: no reward functions at all is allowed (an environment rewards the episodes); the
        total is then 0 and there are no parts. ``where``: how errors name the list (``model.rewards``)."""
        if not rewards and not allow_empty:
            raise AlignConfigError(f"{where}: expected at least one reward function, got none")
        self.rewards = [r if isinstance(r, RewardFunction) else RewardFunction(r) for r in rewards]
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise AlignConfigError(f"{where}: expected unique metric names, got {names}; set 'name' on the duplicates")
        self.last_counts = RewardCounts()

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def check_inputs(self, columns: Sequence[str]) -> None:
        """Fail before any rollout when a reward requires an argument that the data columns ``columns`` and the
        rollout do not provide (:meth:`RewardFunction.check_inputs`)."""
        for reward in self.rewards:
            reward.check_inputs(columns)

    def __call__(
        self, prompts: list[str], completions: list[str], **columns
    ) -> tuple[list[float], dict[str, list[float]]]:
        """``(total, {name: values})``: the weighted total and each reward's own values, per completion (0 where a
        reward does not apply; :attr:`last_counts` counts those rows)."""
        self.check_inputs([k for k in columns if k not in REWARD_INPUTS])
        values = evaluate(self.rewards, {"prompts": prompts, "completions": completions, **columns})
        self.last_counts = RewardCounts(
            len(completions),
            {r.name: sum(v is None for v in values[r.name]) for r in self.rewards},
            {r.name: r.take_errors() for r in self.rewards if r.counts_errors},
        )
        total = [
            float(sum(r.weight * v for r in self.rewards if (v := values[r.name][i]) is not None))
            for i in range(len(completions))
        ]
        return total, {name: [0.0 if v is None else v for v in vals] for name, vals in values.items()}


def training_rewards(
    rewards: Sequence[RewardSpec | str] | None,
    reward_model: RewardModelSpec | str | None,
    eval_rewards: Sequence[RewardSpec | str] | None,
    environment: bool = False,
    where: str | None = "model",
) -> tuple[CombinedReward, list[str]]:
    """The reward list of an RL run and the names of its eval rewards.

    The reward model (the reward named ``rm``) comes first, then ``rewards``; ``eval_rewards`` join with weight
    0, so they are computed, checked and logged (``rollout/reward/<name>``, ``val/reward/<name>``) but never
    trained on, e.g. a task's true verifiable reward next to a reward model's score, so reward hacking shows.
    With ``environment`` (a multi-turn run, whose environment rewards the episodes) the list may be empty.
    ``where``: the config block that holds the settings (``model``), so that an error names its setting
    (``model.rewards[1].timeout``); None (rewards given on the command line) names the reward instead.
    """

    def built(spec, key: str) -> RewardFunction:
        if isinstance(spec, RewardFunction):
            return spec
        return RewardFunction(spec, setting=f"{where}.{key}" if where else None)

    specs = [built(s, f"rewards[{i}]") for i, s in enumerate(rewards or [])]
    if isinstance(reward_model, str):
        reward_model = RewardModelSpec(reward_model)
    if reward_model is not None:
        rm = built(LazyRewardModel(reward_model.path, reward_model.batch_size), "reward_model")
        rm.name, rm.weight = "rm", float(reward_model.weight)
        specs.insert(0, rm)
    if not specs and not environment:
        raise AlignConfigError(
            f"{where}.rewards: an RL run needs a training reward; set reward_model, rewards or environment"
            if where
            else "rewards: expected at least one reward, got none"
        )
    evals = [
        built(
            dataclasses.replace(s, weight=0.0, kwargs=dict(s.kwargs))
            if isinstance(s, RewardSpec)
            else RewardSpec(fn=s, weight=0.0),
            f"eval_rewards[{i}]",
        )
        for i, s in enumerate(eval_rewards or [])
    ]
    names = [r.name for r in [*specs, *evals]]
    if len(set(names)) != len(names):
        raise AlignConfigError(
            f"{where}.rewards: expected unique metric names across reward_model ('rm'), rewards "
            f"and eval_rewards, got {names}; set 'name' on the duplicates"
            if where
            else f"rewards: expected unique metric names, got {names}; set 'name' on the duplicates"
        )
    combined = CombinedReward([*specs, *evals], allow_empty=environment)
    return combined, combined.names[len(specs) :]

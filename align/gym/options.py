"""Typed option groups of the classic-RL modules.

Each group is one nested YAML block under ``model:`` (``gae:``, ``clip:``, ``value:``, ``updates:``, ...), with its
fields documented below and checked when it is built, so ``--help`` lists them and a bad value fails on one line
that names its key. The groups shared with the language-model modules (:mod:`align.modules.options`) keep their
names and field names where the meaning is the same: ``gae.gamma``, ``gae.lam``, ``gae.whiten_advantages``,
``clip.low``, ``clip.high``, ``value.coef``, ``value.clip``, ``updates.epochs``, ``updates.max_grad_norm``, and the
plain ``entropy_coef``. What only classic RL has is named in its group: ``clip.schedule``,
``updates.minibatch_size`` (rows, as Stable-Baselines3's ``batch_size``), ``updates.target_kl``,
``updates.gradient_steps``. A module whose default differs (PPO's ten epochs, A2C's lambda of 1) declares its own
default instance of the group; every other field keeps the group's default. docs/classic_rl.md maps
Stable-Baselines3's names to these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeVar

from align.errors import AlignConfigError
from align.gym.networks import Activation
from align.modules.options import GAE

Schedule = Literal["constant", "linear"]


def _check(ok: bool, key: str, expected: str, got) -> None:
    if not ok:
        raise AlignConfigError(f"model.{key}: expected {expected}, got {got!r}")


Group = TypeVar("Group")


def as_group(cls: type[Group], value: Group | dict) -> Group:
    """``value`` as an instance of the group ``cls`` (a dict gives its fields, as Python callers may pass)."""
    return cls(**value) if isinstance(value, dict) else value


@dataclass(frozen=True)
class GymGAE(GAE):
    """Generalised advantage estimation over environment steps (Schulman et al. 2016): terminations end the
    bootstrap, time-limit truncations bootstrap from the value of the state the episode was cut off in. The
    language-model modules' ``gae`` group (the same checks) with per-step defaults."""

    gamma: float = 0.99
    """Discount per environment step."""
    lam: float = 0.95
    """Lambda: 0 is the one-step TD error, 1 the return to the window's end minus the value (REINFORCE: 1 only)."""
    whiten_advantages: bool = True
    """Whiten the advantages of each minibatch (A2C and REINFORCE: of the iteration's one update)."""


@dataclass(frozen=True)
class GymClipRange:
    """PPO's clipping of the probability ratio in the surrogate loss to ``[1 - low, 1 + high]``."""

    low: float = 0.2
    """Lower clip range (``1 - low``)."""
    high: float | None = None
    """Upper clip range (``1 + high``); null: equal to ``low``."""
    schedule: Schedule = "constant"
    """``linear``: both ranges fall linearly to 0 at ``total_steps``; ``constant``: they stay."""

    def __post_init__(self) -> None:
        _check(self.low > 0, "clip.low", "> 0", self.low)
        _check(self.high is None or self.high > 0, "clip.high", "> 0 or null", self.high)
        _check(self.schedule in ("constant", "linear"), "clip.schedule", "'constant' or 'linear'", self.schedule)


@dataclass(frozen=True)
class GymValueTraining:
    """How the value network (the critic, or the baseline of REINFORCE) is trained."""

    coef: float = 1.0
    """Weight of the value loss ``0.5 * (V - R)^2`` in the joint loss (Stable-Baselines3's ``vf_coef`` weighs
    ``(V - R)^2``: its 0.5 is 1.0 here)."""
    clip: float | None = None
    """PPO: clip new values to ``old -/+ clip`` in the value loss; null: no clipping."""

    def __post_init__(self) -> None:
        _check(self.coef >= 0, "value.coef", ">= 0", self.coef)
        _check(self.clip is None or self.clip > 0, "value.clip", "> 0 or null", self.clip)


@dataclass(frozen=True)
class GymUpdates:
    """How an on-policy rollout is consumed: passes, minibatches, gradient clipping, PPO's early stop."""

    epochs: int = 1
    """Passes over each rollout (PPO; A2C and REINFORCE take one)."""
    minibatch_size: int | None = None
    """Transitions per minibatch, one optimizer step each, drawn without replacement in each pass (the last one of
    a pass is smaller when it does not divide the rollout); null: the whole rollout in one."""
    max_grad_norm: float | None = 0.5
    """Clip the gradient norm of every optimizer step; null: no clipping."""
    target_kl: float | None = None
    """PPO: stop an iteration's remaining epochs once the approximate KL of a pass's last minibatch exceeds 1.5
    times this; null: never."""

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, "updates.epochs", ">= 1", self.epochs)
        _check(
            self.minibatch_size is None or self.minibatch_size >= 1,
            "updates.minibatch_size",
            ">= 1 or null",
            self.minibatch_size,
        )
        _check(
            self.max_grad_norm is None or self.max_grad_norm > 0,
            "updates.max_grad_norm",
            "> 0 or null",
            self.max_grad_norm,
        )
        _check(self.target_kl is None or self.target_kl > 0, "updates.target_kl", "> 0 or null", self.target_kl)


@dataclass(frozen=True)
class ReplayUpdates:
    """How DQN learns from its replay buffer in each iteration (once ``learning_starts`` steps are stored)."""

    gradient_steps: int = 1
    """Optimizer steps per iteration, each on its own minibatch; 0: the iterations only collect."""
    minibatch_size: int = 64
    """Transitions sampled from the replay buffer per optimizer step."""
    max_grad_norm: float | None = 10.0
    """Clip the gradient norm of every optimizer step; null: no clipping."""

    def __post_init__(self) -> None:
        _check(self.gradient_steps >= 0, "updates.gradient_steps", ">= 0", self.gradient_steps)
        _check(self.minibatch_size >= 1, "updates.minibatch_size", ">= 1", self.minibatch_size)
        _check(
            self.max_grad_norm is None or self.max_grad_norm > 0,
            "updates.max_grad_norm",
            "> 0 or null",
            self.max_grad_norm,
        )


@dataclass(frozen=True)
class EpisodeEvaluation:
    """Held-out evaluation: greedy episodes on seeds that training never uses."""

    episodes: int = 20
    """Episodes per evaluation, played at once (one environment each)."""
    deterministic: bool = True
    """Take the policy's most likely action (greedy); false samples as in training."""

    def __post_init__(self) -> None:
        _check(self.episodes >= 1, "evaluation.episodes", ">= 1", self.episodes)


@dataclass(frozen=True)
class Network:
    """The actor-critic network of PPO, A2C and REINFORCE."""

    hidden: tuple[int, ...] = (64, 64)
    """Hidden layer widths."""
    activation: Activation = "tanh"
    """``tanh`` or ``relu``."""
    shared: bool = False
    """One trunk for policy and value (two heads) instead of two separate networks."""
    log_std_init: float = 0.0
    """Initial log standard deviation of a continuous-action policy."""


@dataclass(frozen=True)
class Exploration:
    """Epsilon-greedy exploration: epsilon moves linearly from ``initial`` to ``final`` over the first ``fraction`` of
    ``total_steps``, then stays at ``final``."""

    initial: float = 1.0
    """Epsilon at the first step."""
    final: float = 0.05
    """Epsilon after the annealing."""
    fraction: float = 0.1
    """Share of ``total_steps`` over which epsilon anneals."""

    def __post_init__(self) -> None:
        for name in ("initial", "final", "fraction"):
            _check(0.0 <= getattr(self, name) <= 1.0, f"exploration.{name}", "a value in [0, 1]", getattr(self, name))


__all__ = [
    "EpisodeEvaluation",
    "Exploration",
    "GymClipRange",
    "GymGAE",
    "GymUpdates",
    "GymValueTraining",
    "Network",
    "ReplayUpdates",
    "as_group",
]

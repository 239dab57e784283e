"""Gymnasium vector environments from a config: a registered id (``CartPole-v1``) or a user's own environment
class named by import path (``my_envs.py:GridWorld``, ``my_package.envs.GridWorld``).

Every vector environment is built with Gymnasium's autoreset *disabled*: the :class:`~align.gym.runner.EnvRunner`
resets finished episodes itself, each with a seed of its own, so a run that resumes after a kill can rebuild
every episode in progress exactly (see the runner).
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from align.errors import AlignConfigError

try:
    import gymnasium as gym
    from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv
except ImportError as err:  # an optional extra
    raise AlignConfigError(f"classic RL needs gymnasium >= 1.1 ({err}): pip install 'align[gym]'") from err
from align.rollout.rewards import resolve_import


@dataclass(frozen=True)
class EnvSpec:
    """The environment a classic-RL module trains on."""

    id: str = "CartPole-v1"
    """A Gymnasium id (``CartPole-v1``, ``FrozenLake-v1``, ``module:Id`` to import a module that registers it) or
    the import path of an environment class or factory (``my_envs.py:GridWorld``, ``pkg.envs.GridWorld``)."""
    num_envs: int = 1
    """Environments stepped together (one batched policy call per step)."""
    vectorization: Literal["sync", "async"] = "sync"
    """``sync``: all environments in this process, one after another. ``async``: one process per environment (worth
    it when a step costs more than a millisecond)."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (``{is_slippery: false}`` for FrozenLake)."""
    max_episode_steps: int | None = None
    """Time limit of an episode; null: the registered one (CartPole-v1: 500), none for a class without one."""
    seed: int = 0
    """Seed of every episode's reset (each episode gets its own seed derived from this one)."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id.strip():
            raise AlignConfigError(f"model.env.id: expected a Gymnasium id or an import path, got {self.id!r}")
        if self.num_envs < 1:
            raise AlignConfigError(f"model.env.num_envs: expected >= 1, got {self.num_envs}")
        if self.vectorization not in ("sync", "async"):
            raise AlignConfigError(f"model.env.vectorization: expected 'sync' or 'async', got {self.vectorization!r}")
        if self.max_episode_steps is not None and self.max_episode_steps < 1:
            raise AlignConfigError(f"model.env.max_episode_steps: expected >= 1 or null, got {self.max_episode_steps}")


def as_spec(env: EnvSpec | str | dict) -> EnvSpec:
    """An :class:`EnvSpec` from itself, an id string, or a mapping of its fields."""
    if isinstance(env, EnvSpec):
        return env
    if isinstance(env, str):
        return EnvSpec(id=env)
    if isinstance(env, dict):
        return EnvSpec(**env)
    raise AlignConfigError(f"model.env: expected an id or {{id, num_envs, ...}}, got {env!r}")


class ObservationError(ValueError):
    """An environment returned an observation outside its declared observation space."""


class CheckObservations(gym.Wrapper):
    """Checks every observation against the declared space's shape (a ``Box``) or range (a ``Discrete``), so a
    wrong one fails where it is made, naming the space, instead of deep in a vector environment's buffer copy or
    a network's input. Costs a shape comparison per step."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        space = env.observation_space
        self._shape = tuple(space.shape) if isinstance(space, gym.spaces.Box) else None
        self._n = int(space.n) if isinstance(space, gym.spaces.Discrete) else None
        self._start = int(getattr(space, "start", 0)) if self._n is not None else 0

    def _check(self, obs, where: str):
        if self._shape is not None:
            shape = tuple(getattr(obs, "shape", ()))
            if shape != self._shape:
                raise ObservationError(
                    f"{where} returned an observation of shape {shape}, outside its observation "
                    f"space {space_text(self.observation_space)}"
                )
        elif self._n is not None:
            if not (isinstance(obs, (int, np.integer)) and self._start <= int(obs) < self._start + self._n):
                raise ObservationError(
                    f"{where} returned the observation {obs!r}, outside its observation space "
                    f"{space_text(self.observation_space)}"
                )
        return obs

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return self._check(obs, "reset"), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return self._check(obs, "step"), reward, terminated, truncated, info


def _registered(env_id: str) -> bool:
    if env_id in gym.registry:
        return True
    # ``module:Id`` imports ``module``, which registers ``Id``.
    module, sep, name = env_id.partition(":")
    return bool(sep) and not module.endswith(".py") and "-v" in name


def _unknown(env_id: str) -> AlignConfigError:
    close = difflib.get_close_matches(env_id, list(gym.registry), n=3, cutoff=0.6)
    hint = f"; close registered ids: {', '.join(close)}" if close else ""
    return AlignConfigError(
        f"environment '{env_id}': not a registered Gymnasium id and not an import path of an "
        f"environment class (such as 'my_envs.py:GridWorld'){hint}"
    )


def _make_one(env_id: str, kwargs: dict, max_episode_steps: int | None) -> gym.Env:
    """One environment (module-level, so ``async`` workers can unpickle the factory)."""
    if _registered(env_id):
        env = gym.make(env_id, max_episode_steps=max_episode_steps, disable_env_checker=True, **kwargs)
    else:
        target = resolve_import(env_id, what="environment")
        env = target(**kwargs)
        if not isinstance(env, gym.Env):
            raise AlignConfigError(
                f"environment '{env_id}': calling it gave a {type(env).__name__}, not a gymnasium.Env"
            )
        if max_episode_steps is not None:
            env = gym.wrappers.TimeLimit(env, max_episode_steps)
    return CheckObservations(env)


def make_env(spec: EnvSpec) -> gym.Env:
    """One environment of ``spec``, with one-line errors for an unknown id or a constructor that fails."""
    env_id = spec.id.strip()
    looks_like_path = ":" in env_id or "." in env_id
    if not _registered(env_id) and not looks_like_path:
        raise _unknown(env_id)
    try:
        return _make_one(env_id, dict(spec.kwargs), spec.max_episode_steps)
    except AlignConfigError:
        raise
    except gym.error.Error as err:
        raise AlignConfigError(f"environment '{env_id}': {type(err).__name__}: {err}") from err
    except TypeError as err:
        raise AlignConfigError(
            f"environment '{env_id}': its constructor refused model.env.kwargs {dict(spec.kwargs)}: {err}"
        ) from err
    except Exception as err:  # noqa: BLE001 - user code may raise anything
        raise AlignConfigError(f"environment '{env_id}': building it failed: {type(err).__name__}: {err}") from err


def make_vector_env(spec: EnvSpec, num_envs: int | None = None) -> SyncVectorEnv | AsyncVectorEnv:
    """``num_envs`` (default ``spec.num_envs``) copies of the environment as one vector environment, autoreset
    disabled. The first copy is built here, so a bad id or constructor fails in this process with one line."""
    n = spec.num_envs if num_envs is None else num_envs
    probe = make_env(spec)  # fails early, here, on one line
    factory = functools.partial(_make_one, spec.id.strip(), dict(spec.kwargs), spec.max_episode_steps)
    if spec.vectorization == "sync":
        fns = [lambda probe=probe: probe] + [factory] * (n - 1)
        return SyncVectorEnv(fns, autoreset_mode=AutoresetMode.DISABLED, copy=False)
    probe.close()
    return AsyncVectorEnv([factory] * n, autoreset_mode=AutoresetMode.DISABLED, copy=False)


def space_text(space: gym.Space) -> str:
    """A short description of a space for error messages: ``Discrete(2)``, ``Box(shape=(4,), float32)``."""
    if isinstance(space, gym.spaces.Box):
        return f"Box(shape={tuple(space.shape)}, {space.dtype})"
    return repr(space)


def require_discrete_actions(spec: EnvSpec, space: gym.Space, algorithm: str) -> int:
    """The number of actions of a ``Discrete`` action space; a one-line error for any other space."""
    if not isinstance(space, gym.spaces.Discrete):
        raise AlignConfigError(
            f"environment '{spec.id}': {algorithm} needs a Discrete action space, got "
            f"{space_text(space)}; use PPO, A2C or REINFORCE for continuous actions"
        )
    return int(space.n)


def describe(env: Any) -> str:
    """``'CartPole-v1'`` or the class name of an environment, for messages."""
    spec = getattr(env, "spec", None)
    return getattr(spec, "id", None) or type(getattr(env, "unwrapped", env)).__name__


__all__ = [
    "CheckObservations",
    "EnvSpec",
    "ObservationError",
    "as_spec",
    "describe",
    "make_env",
    "make_vector_env",
    "require_discrete_actions",
    "space_text",
]

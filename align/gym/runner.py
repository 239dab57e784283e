"""The one place where a classic-RL policy meets its environments: :class:`EnvRunner` steps a vector environment
with a policy, records windows of steps (:class:`Steps`) and finished episodes (:class:`Episode`), and can be saved
and restored mid-episode.

Seeds and exact resume. Gymnasium's autoreset is off (:func:`~align.gym.make.make_vector_env`): the runner resets
each finished environment itself, with a seed drawn for that environment's k-th episode from
``(EnvSpec.seed, stream, environment index, k)``. A Gymnasium environment is deterministic given its reset seed
and the actions taken since, so the runner's state is small: each environment's episode number and the actions of
the episode in progress. :meth:`EnvRunner.load_state_dict` resets every environment with its episode's seed and
replays those actions, which puts every environment back where the killed run left it, without pickling any
environment. An environment whose replay does not reproduce the saved observation (one that draws randomness
outside its ``np_random``) is warned about once; its episode continues from the replayed state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import SyncVectorEnv

from align.errors import AlignEnvError
from align.gym.make import EnvSpec, ObservationError, make_vector_env, space_text

log = logging.getLogger(__name__)

Policy = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``policy(observations (N, *obs)) -> (actions (N, *act), extras)``; ``extras`` holds per-environment tensors
recorded with each step (the action's log-prob, the state's value). ``extras["env_actions"]``, when present, is what
the environments receive instead of ``actions`` (continuous actions clipped to their bounds)."""
OnStep = Callable[["Transition"], None]


@dataclass
class Transition:
    """One vector step: ``N`` environments, each ``s -> a -> r, s'``."""

    observations: torch.Tensor  # (N, *obs) s
    actions: torch.Tensor  # (N, *act) a
    rewards: torch.Tensor  # (N,) float32
    next_observations: torch.Tensor  # (N, *obs) s' (the final observation where the episode ended)
    terminated: torch.Tensor  # (N,) bool: s' is terminal
    done: torch.Tensor  # (N,) bool: the episode ended at this step (terminated or truncated)


@dataclass
class Steps:
    """A window of ``T`` vector steps over ``N`` environments, time first."""

    observations: torch.Tensor  # (T, N, *obs)
    actions: torch.Tensor  # (T, N, *act)
    rewards: torch.Tensor  # (T, N) float32
    next_observations: torch.Tensor  # (T, N, *obs) the final observation where an episode ended
    terminated: torch.Tensor  # (T, N) bool
    done: torch.Tensor  # (T, N) bool
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # (T, N, ...) from the policy
    valid: torch.Tensor | None = None  # (T, N) bool: the steps that count; None: all of them

    @property
    def shape(self) -> tuple[int, int]:
        return self.rewards.shape[0], self.rewards.shape[1]  # (T, N)

    @property
    def count(self) -> int:
        """Steps that count."""
        return int(self.valid.sum()) if self.valid is not None else self.rewards.numel()


@dataclass(frozen=True)
class Episode:
    """A finished episode."""

    reward: float  # undiscounted return
    length: int  # steps
    index: int  # 1 for the run's first finished episode, counting all environments
    truncated: bool  # ended by a time limit, not a terminal state


def episode_seed(seed: int, stream: int, env_index: int, episode: int) -> int:
    """The reset seed of environment ``env_index``'s ``episode``-th episode in a runner of ``EnvSpec.seed`` ``seed``
    and ``stream`` (training 0, evaluation 1): a 32-bit draw from ``numpy.random.SeedSequence`` of the four, so the
    episodes of every environment, stream and run seed get seeds of their own. Another library's environments reset
    with these seeds start the same episodes as the runner's (``benchmarks/gym.py`` evaluates SB3 on align's
    held-out states this way)."""
    entropy = [int(seed), int(stream), int(env_index), int(episode)]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint32)[0])


class EnvRunner:
    """Steps ``spec``'s vector environment with a policy; see the module docstring for seeds and resume.

    ``stream`` separates the episode seeds of several runners on one spec (training 0, evaluation 1).
    """

    def __init__(self, spec: EnvSpec, num_envs: int | None = None, stream: int = 0):
        self.spec, self.stream = spec, stream
        self.env = make_vector_env(spec, num_envs)
        self.num_envs = self.env.num_envs
        self.observation_space = self.env.single_observation_space
        self.action_space = self.env.single_action_space
        self.steps = 0  # environment steps taken, over all environments
        self.episodes = 0  # episodes finished
        self.env_seconds = 0.0  # wall time inside the environments' step and reset
        self.finished: list[Episode] = []
        self._episode = np.zeros(self.num_envs, dtype=np.int64)  # each environment's episode number
        self._return = np.zeros(self.num_envs, dtype=np.float64)
        self._length = np.zeros(self.num_envs, dtype=np.int64)
        self._actions: list[list[np.ndarray]] = [[] for _ in range(self.num_envs)]
        self._obs: torch.Tensor | None = None
        # Synchronous copies whose observations are arrays or integers are stepped and reset here, one after
        # another, rather than through SyncVectorEnv.step: the runner resets episodes itself and reads no infos,
        # so Gymnasium's per-step info merging, action iteration and buffer concatenation are skipped. For
        # CartPole that halves what a vector step costs beyond the environments' own step functions.
        space = self.observation_space
        direct = isinstance(space, (gym.spaces.Box, gym.spaces.Discrete))
        self._copies: list[gym.Env] | None = (
            list(self.env.envs) if isinstance(self.env, SyncVectorEnv) and direct else None
        )
        self._latest = (
            np.zeros((self.num_envs, *(space.shape or ())), dtype=space.dtype) if self._copies is not None else None
        )

    # ------------------------------------------------------------------ seeds, resets, conversions
    def episode_seed(self, env_index: int, episode: int) -> int:
        """The reset seed of environment ``env_index``'s ``episode``-th episode (:func:`episode_seed`)."""
        return episode_seed(self.spec.seed, self.stream, env_index, episode)

    def _observations(self, obs: np.ndarray) -> torch.Tensor:
        out = torch.from_numpy(np.array(obs))  # a copy: the vector environment (or the runner) reuses its buffer
        expected = tuple(self.observation_space.shape or ())
        if tuple(out.shape[1:]) != expected:
            raise AlignEnvError(
                f"environment '{self.spec.id}': observations of shape {tuple(out.shape[1:])} do not "
                f"match its observation space {space_text(self.observation_space)}"
            )
        return out

    def _seeds(self, mask: np.ndarray | None) -> list[int | None]:
        """The reset seeds of the environments in ``mask`` (all without one); ``None`` for the others."""
        return [self.episode_seed(i, int(e)) if mask is None or mask[i] else None for i, e in enumerate(self._episode)]

    def _reset(self, mask: np.ndarray | None, seeds: list[int | None]) -> None:
        start = time.perf_counter()
        try:
            if self._copies is None:
                obs, _ = self.env.reset(seed=seeds, options=None if mask is None else {"reset_mask": mask})
            else:
                obs = self._latest
                assert obs is not None  # built with the copies
                for i in range(self.num_envs) if mask is None else np.flatnonzero(mask):
                    obs[i], _ = self._copies[i].reset(seed=seeds[i])
        except ObservationError as err:
            raise AlignEnvError(f"environment '{self.spec.id}': {err}") from err
        except Exception as err:  # noqa: BLE001 - user environments may raise anything
            raise AlignEnvError(f"environment '{self.spec.id}': reset raised {type(err).__name__}: {err}") from err
        self.env_seconds += time.perf_counter() - start
        self._obs = self._observations(obs)

    def _step(self, actions: np.ndarray):
        start = time.perf_counter()
        try:
            if self._copies is None:
                obs, rewards, terminated, truncated, _ = self.env.step(actions)
            else:
                obs, rewards, terminated, truncated = self._step_copies(actions)
        except ObservationError as err:
            raise AlignEnvError(f"environment '{self.spec.id}': {err}") from err
        except Exception as err:  # noqa: BLE001
            episodes = ", ".join(str(int(e)) for e in self._episode)
            raise AlignEnvError(
                f"environment '{self.spec.id}': step raised {type(err).__name__}: {err} (episodes "
                f"{episodes} of its {self.num_envs} copies)"
            ) from err
        self.env_seconds += time.perf_counter() - start
        return obs, rewards, terminated, truncated

    def _step_copies(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One synchronous vector step, each copy stepped here (see ``__init__``); the observations are written
        into the runner's buffer, which :meth:`_observations` copies."""
        n = self.num_envs
        rewards, terminated, truncated = np.zeros(n), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        obs = self._latest
        assert self._copies is not None and obs is not None  # called only with the copies
        for i, (env, action) in enumerate(zip(self._copies, actions)):
            obs[i], rewards[i], terminated[i], truncated[i], _ = env.step(action)
        return obs, rewards, terminated, truncated

    def start(self) -> torch.Tensor:
        """The current observations ``(N, *obs)``, resetting every environment on first use."""
        if self._obs is None:
            self._reset(None, self._seeds(None))
        assert self._obs is not None  # set by _reset
        return self._obs

    @staticmethod
    def _as_numpy(actions: torch.Tensor) -> np.ndarray:
        return actions.detach().cpu().numpy()

    # ------------------------------------------------------------------ stepping
    def step(self, policy: Policy) -> tuple[Transition, dict[str, torch.Tensor]]:
        """One vector step with ``policy``; finished episodes are recorded and their environments reset."""
        obs = self.start()
        actions, extras = policy(obs)
        numpy_actions = self._as_numpy(extras.pop("env_actions", actions))
        next_obs, rewards, terminated, truncated = self._step(numpy_actions)
        next_obs = self._observations(next_obs)
        done = np.logical_or(terminated, truncated)
        self.steps += self.num_envs
        self._return += rewards
        self._length += 1
        for i in range(self.num_envs):
            self._actions[i].append(numpy_actions[i])
        # torch.from_numpy of fresh arrays: a third of what torch.as_tensor costs on arrays of a few elements.
        transition = Transition(
            obs,
            actions,
            torch.from_numpy(np.array(rewards, dtype=np.float32)),
            next_obs,
            torch.from_numpy(np.array(terminated, dtype=bool)),
            torch.from_numpy(done),
        )
        if done.any():
            self._finish(done, truncated & ~terminated)
        else:
            self._obs = next_obs
        return transition, extras

    def _finish(self, done: np.ndarray, truncated: np.ndarray) -> None:
        for i in np.flatnonzero(done):
            self.episodes += 1
            self.finished.append(
                Episode(float(self._return[i]), int(self._length[i]), self.episodes, bool(truncated[i]))
            )
            self._return[i], self._length[i] = 0.0, 0
            self._actions[i] = []
            self._episode[i] += 1
        self._reset(done, self._seeds(done))

    def collect(self, policy: Policy, num_steps: int, on_step: OnStep | None = None) -> Steps:
        """``num_steps`` vector steps (``num_steps * N`` environment steps), continuing the episodes in progress.
        ``on_step`` sees every transition as it happens (tabular Q-learning learns from each one)."""
        if num_steps < 1:
            raise ValueError(f"EnvRunner.collect: num_steps must be >= 1, got {num_steps}")
        records: list[tuple[Transition, dict[str, torch.Tensor]]] = []
        for _ in range(num_steps):
            transition, extras = self.step(policy)
            if on_step is not None:
                on_step(transition)
            records.append((transition, extras))
        return _stack(records)

    def collect_episodes(self, policy: Policy, max_steps: int = 100_000) -> Steps:
        """One complete episode per environment, from a fresh reset: ``valid`` marks each environment's steps up to
        and including the end of its first episode. Environments that finish early are reset and keep stepping
        (their steps are not valid), so every episode counts once whatever its length: taking the first episodes
        to end would favour short ones. Episodes in progress before the call are dropped unrecorded."""
        self._episode += self._length > 0
        self._return[:], self._length[:] = 0.0, 0
        self._actions = [[] for _ in range(self.num_envs)]
        self._reset(None, self._seeds(None))
        records: list[tuple[Transition, dict[str, torch.Tensor]]] = []
        valid: list[torch.Tensor] = []
        running = torch.ones(self.num_envs, dtype=torch.bool)
        while bool(running.any()):
            if len(records) >= max_steps:
                raise AlignEnvError(
                    f"environment '{self.spec.id}': an episode ran {max_steps} steps without ending; "
                    "set model.env.max_episode_steps"
                )
            transition, extras = self.step(policy)
            records.append((transition, extras))
            valid.append(running.clone())
            running &= ~transition.done
        steps = _stack(records)
        steps.valid = torch.stack(valid)
        return steps

    def rewind(self) -> None:
        """Start every environment's episode count over: the next :meth:`collect_episodes` plays the same seeds
        as the first one did (held-out evaluation)."""
        self._episode[:] = 0
        self._length[:] = 0

    def pop_episodes(self) -> list[Episode]:
        """Episodes finished since the last call."""
        out, self.finished = self.finished, []
        return out

    def close(self) -> None:
        self.env.close()

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        """Counters and the episodes in progress (tensors and numbers only, loadable with ``weights_only``)."""
        return {
            "steps": self.steps,
            "episodes": self.episodes,
            "episode": torch.from_numpy(self._episode.copy()),
            "return": torch.from_numpy(self._return.copy()),
            "length": torch.from_numpy(self._length.copy()),
            "actions": [torch.from_numpy(np.stack(a)) if a else torch.zeros(0) for a in self._actions],
            "observations": self._obs.clone() if self._obs is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters and rebuild every episode in progress by replaying its actions (module docstring)."""
        if len(state["actions"]) != self.num_envs:
            raise AlignEnvError(
                f"environment '{self.spec.id}': the checkpoint holds {len(state['actions'])} "
                f"environments, this run has {self.num_envs} (model.env.num_envs)"
            )
        self.steps, self.episodes = int(state["steps"]), int(state["episodes"])
        self._episode = state["episode"].numpy().astype(np.int64).copy()
        self._return = state["return"].numpy().astype(np.float64).copy()
        self._length = state["length"].numpy().astype(np.int64).copy()
        actions = [a.numpy() for a in state["actions"]]
        self._actions = [list(a) for a in actions]
        if state["observations"] is None:
            self._obs = None
            return
        self._replay(actions)
        assert self._obs is not None  # set by the replay's reset
        if not torch.allclose(self._obs.double(), state["observations"].double(), atol=1e-6):
            log.warning(
                "environment '%s' did not reproduce its episodes from their seeds and actions; the resumed "
                "run continues from the replayed states",
                self.spec.id,
            )

    def _replay(self, actions: list[np.ndarray]) -> None:
        """Step every environment through its saved actions, all in lockstep: an environment with fewer actions is
        reset with its episode's seed later, after stepping through filler actions it then forgets."""
        lengths = [len(a) for a in actions]
        longest = max(lengths, default=0)
        starts = [longest - n for n in lengths]
        filler = 2**31 - 1  # the seed of the throw-away episodes before an environment's replay starts
        self.action_space.seed(int(self.spec.seed))
        seeds: list[int | None] = [
            self.episode_seed(i, int(self._episode[i])) if starts[i] == 0 else filler for i in range(self.num_envs)
        ]
        self._reset(None, seeds)
        for k in range(longest):
            batch = np.stack(
                [
                    actions[i][k - starts[i]] if k >= starts[i] else self.action_space.sample()
                    for i in range(self.num_envs)
                ]
            )
            obs, _, terminated, truncated = self._step(batch)
            self._obs = self._observations(obs)
            begin = np.array([s == k + 1 for s in starts])
            idle = np.array([s > k for s in starts])  # stepped with filler actions
            reset = begin | (idle & np.logical_or(terminated, truncated))
            if reset.any():
                self._reset(
                    reset,
                    [
                        self.episode_seed(i, int(self._episode[i])) if begin[i] else filler if reset[i] else None
                        for i in range(self.num_envs)
                    ],
                )


def _stack(records: list[tuple[Transition, dict[str, torch.Tensor]]]) -> Steps:
    transitions = [t for t, _ in records]
    extras = {k: torch.stack([e[k] for _, e in records]) for k in (records[0][1] if records else {})}
    return Steps(
        observations=torch.stack([t.observations for t in transitions]),
        actions=torch.stack([t.actions for t in transitions]),
        rewards=torch.stack([t.rewards for t in transitions]),
        next_observations=torch.stack([t.next_observations for t in transitions]),
        terminated=torch.stack([t.terminated for t in transitions]),
        done=torch.stack([t.done for t in transitions]),
        extras=extras,
    )


__all__ = ["Episode", "EnvRunner", "OnStep", "Policy", "Steps", "Transition", "episode_seed"]

"""Value-based classic RL: DQN (with Double DQN, Huber loss, hard or Polyak target updates) and tabular Q-learning.

Both act epsilon-greedily with a linearly annealed epsilon (:func:`~align.gym.optim.linear_schedule`) and learn from
one-step targets (:func:`~align.gym.returns.td_targets`). Tabular Q-learning's update
``Q(s, a) += alpha * (target - Q(s, a))`` is taken as a step of plain SGD with learning rate ``alpha`` on
``0.5 * (Q(s, a) - target)^2``, which is the same update, so the table trains, logs and checkpoints like any network.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.cli import OptimizerCallable

from align.errors import AlignConfigError
from align.gym.base import ClassicRLModule, Metrics
from align.gym.make import EnvSpec, require_discrete_actions
from align.gym.networks import Activation, QNetwork, QTable
from align.gym.optim import linear_schedule, polyak_update
from align.gym.options import EpisodeEvaluation, Exploration, ReplayUpdates, Schedule, as_group
from align.gym.replay import ReplayBuffer
from align.gym.returns import td_targets
from align.gym.runner import Policy, Transition

DRAW_BYTES = 64 << 20
"""The most bytes of transitions that DQN draws from its replay buffer at once (several gradient steps' batches)."""

TARGET_ROWS = 1024
"""Rows per call of the target network over a draw's next observations. A 256-wide layer over 8,192 rows writes
8 MB per activation, out of the cache, and on the CPU took 1.6x as long per row as over chunks of 512-1024 rows."""


class _EpsilonGreedy(ClassicRLModule):
    """Acting epsilon-greedily on ``self.q`` (a module mapping observations to ``(N, A)`` values)."""

    exploration: Exploration
    q: QNetwork | QTable
    num_actions: int

    def epsilon(self) -> float:
        return self.epsilon_at(self.env_steps)

    def epsilon_at(self, env_steps: int) -> float:
        return linear_schedule(
            env_steps, self.exploration.initial, self.exploration.final, self.exploration.fraction * self.total_steps
        )

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool) -> torch.Tensor:
        if deterministic:
            return self.q.greedy(obs)
        n = obs.shape[0]
        explore = torch.rand(n) < self.epsilon()
        random = torch.randint(0, self.num_actions, (n,))
        if bool(explore.all()):  # no environment acts greedily: the network's values are not needed
            return random
        return torch.where(explore, random, self.q.greedy(obs))

    def explorer(self, num_steps: int) -> Policy:
        """The epsilon-greedy policy of the next ``num_steps`` vector steps, as :meth:`act` draws it step by step
        (epsilon at each step's environment count), with the steps' uniform and random-action draws taken at once:
        two tensor draws per iteration instead of five small ops per step. The Q-network runs only at steps where
        some environment acts greedily."""
        n = self.runner.num_envs
        start = self.env_steps
        epsilons = torch.tensor([self.epsilon_at(start + k * n) for k in range(num_steps)])
        explore = torch.rand(num_steps, n) < epsilons.unsqueeze(1)  # (T, N)
        random = torch.randint(0, self.num_actions, (num_steps, n))
        every, none = explore.all(dim=1).tolist(), (~explore.any(dim=1)).tolist()
        step = iter(range(num_steps))

        def policy(obs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            k = next(step)
            if every[k]:
                return random[k], {}
            greedy = self.q.greedy(obs)
            return (greedy if none[k] else torch.where(explore[k], random[k], greedy)), {}

        return policy

    def sample_actions(self, obs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One epsilon-greedy step, drawn on its own (a :data:`Policy`); training collects with :meth:`explorer`."""
        return self.act(obs, deterministic=False), {}


class DQNGymModule(_EpsilonGreedy):
    """DQN (Mnih et al. 2015; arXiv 1312.5602): experience replay, a target network, Huber loss; Double DQN
    (van Hasselt et al. 2016, arXiv 1509.06461) as an option. Each iteration takes ``steps_per_iteration`` vector
    steps and then ``updates.gradient_steps`` updates (once ``learning_starts`` steps are stored).

    The target network is copied (``tau: 1``) or Polyak-averaged (``tau < 1``) every ``target_update_interval``
    environment steps, counted during collection as Stable-Baselines3 does."""

    algorithm = "dqn"

    def __init__(
        self,
        env: EnvSpec = EnvSpec(),
        total_steps: int = 50_000,
        buffer_size: int = 100_000,
        learning_starts: int = 1000,
        steps_per_iteration: int = 4,
        updates: ReplayUpdates = ReplayUpdates(),
        gamma: float = 0.99,
        target_update_interval: int = 1000,
        tau: float = 1.0,
        double_dqn: bool = False,
        loss: Literal["huber", "mse"] = "huber",
        exploration: Exploration = Exploration(),
        hidden: tuple[int, ...] = (64, 64),
        activation: Activation = "relu",
        init: Literal["torch", "orthogonal"] = "torch",
        evaluation: EpisodeEvaluation = EpisodeEvaluation(),
        optimizer: OptimizerCallable = torch.optim.Adam,
        lr_schedule: Schedule = "constant",
    ):
        """
        Args:
            env: The environment (Discrete actions).
            total_steps: Environment steps to train for.
            buffer_size: Transitions the replay buffer keeps.
            learning_starts: Environment steps collected before the first update.
            steps_per_iteration: Vector steps per iteration.
            updates: Gradient steps per iteration, transitions per gradient step (``minibatch_size``) and gradient
                clipping.
            gamma: Discount factor.
            target_update_interval: Environment steps between target-network updates.
            tau: 1 copies the online network into the target; below 1 moves the target that share towards it.
            double_dqn: Let the online network choose the next action and the target network value it.
            loss: ``huber`` (smooth L1, as the DQN paper's clipped error) or ``mse``.
            exploration: Epsilon-greedy schedule.
            hidden: Hidden layer widths of the Q-network.
            activation: ``relu`` or ``tanh``.
            init: The Q-network's initial weights: ``torch`` (``nn.Linear``'s default, as Stable-Baselines3's and
                CleanRL's DQN) or ``orthogonal`` (gain sqrt(2) in hidden layers, 1 on the output, zero biases).
            evaluation: Held-out evaluation episodes (greedy).
            optimizer: Optimizer of the Q-network.
            lr_schedule: ``constant``, or ``linear`` decay to 0 at ``total_steps``.
        """
        updates = as_group(ReplayUpdates, updates)
        super().__init__(env, total_steps, evaluation, optimizer, lr_schedule, updates.max_grad_norm)
        self.num_actions = require_discrete_actions(self.env, self.action_space, "DQN")
        for name, value, ok, expected in (
            ("buffer_size", buffer_size, buffer_size >= 1, ">= 1"),
            ("steps_per_iteration", steps_per_iteration, steps_per_iteration >= 1, ">= 1"),
            ("target_update_interval", target_update_interval, target_update_interval >= 1, ">= 1"),
            ("learning_starts", learning_starts, learning_starts >= 0, ">= 0"),
            ("gamma", gamma, 0.0 <= gamma <= 1.0, "a value in [0, 1]"),
            ("tau", tau, 0.0 < tau <= 1.0, "a value in (0, 1]"),
            ("loss", loss, loss in ("huber", "mse"), "'huber' or 'mse'"),
        ):
            if not ok:
                raise AlignConfigError(f"model.{name}: expected {expected}, got {value!r}")
        self.buffer_size, self.learning_starts, self.updates = buffer_size, learning_starts, updates
        self.steps_per_iteration, self.gamma = steps_per_iteration, gamma
        self.target_update_interval, self.tau, self.double_dqn = target_update_interval, tau, double_dqn
        self.loss_kind, self.exploration = loss, as_group(Exploration, exploration)
        self.q = QNetwork(self.observation_space, self.num_actions, hidden, activation, self.env.id, init)
        self.q_target = QNetwork(self.observation_space, self.num_actions, hidden, activation, self.env.id, init)
        self.q_target.load_state_dict(self.q.state_dict())
        self.q_target.requires_grad_(False)
        self.buffer = ReplayBuffer(buffer_size)
        self._target_updates = 0

    def configure_optimizers(self):
        return self.optimizer(self.q.parameters())

    def _store(self, transition: Transition) -> None:
        self.buffer.add(transition)
        due = self.env_steps // self.target_update_interval
        if due > self._target_updates:
            polyak_update(self.q_target, self.q, self.tau)
            self._target_updates = due

    def iteration(self) -> Metrics:
        epsilon = self.epsilon()
        self.collect(self.explorer(self.steps_per_iteration), self.steps_per_iteration, on_step=self._store)
        out: Metrics = {"rollout/epsilon": epsilon, "rollout/buffer_size": float(len(self.buffer))}
        gradient_steps = self.updates.gradient_steps
        if self.env_steps < self.learning_starts or gradient_steps == 0:
            return out
        losses, q_means = [], []
        done, b = 0, self.updates.minibatch_size
        while done < gradient_steps:
            # The target network does not change during an iteration's gradient steps (it is updated during
            # collection), so the batches of several steps are drawn at once and their target values computed in
            # one pass: the same targets as step by step, at the cost of one larger matmul.
            count = min(gradient_steps - done, self._steps_per_draw())
            batches = self.buffer.sample(count * b)
            with torch.no_grad():
                next_q_target = torch.cat(
                    [
                        self.q_target(rows)
                        for rows in batches["next_observations"].split(TARGET_ROWS)  # (count * B, A)
                    ]
                )
                targets = (
                    None
                    if self.double_dqn
                    else td_targets(batches["rewards"], next_q_target, batches["terminated"], self.gamma)
                )
            actions = batches["actions"].long().view(-1, 1)
            with torch.enable_grad():
                for rows in (slice(i * b, (i + 1) * b) for i in range(count)):
                    if targets is None:  # Double DQN: the online network, as of this step, picks the next action
                        with torch.no_grad():
                            step_targets = td_targets(
                                batches["rewards"][rows],
                                next_q_target[rows],
                                batches["terminated"][rows],
                                self.gamma,
                                self.q(batches["next_observations"][rows]),
                            )
                    else:
                        step_targets = targets[rows]
                    q = self.q(batches["observations"][rows]).gather(1, actions[rows]).squeeze(1)
                    loss = (
                        F.smooth_l1_loss(q, step_targets)
                        if self.loss_kind == "huber"
                        else 0.5 * F.mse_loss(q, step_targets)
                    )
                    self.optimizer_step(loss)
                    losses.append(loss.detach())
                    q_means.append(q.detach().mean())
            done += count
        out["train/loss"] = lambda: float(torch.stack(losses).mean())  # computed when logged
        out["train/q_mean"] = lambda: float(torch.stack(q_means).mean())
        return out

    def _steps_per_draw(self) -> int:
        """Gradient steps whose batches are drawn together: all of an iteration's, up to 64 MiB of transitions."""
        row_bytes = sum(store[0].numel() * store.element_size() for store in self.buffer.storage.values())
        return max(1, DRAW_BYTES // max(row_bytes * self.updates.minibatch_size, 1))

    def extra_state(self) -> dict:
        return {"buffer": self.buffer.state_dict(), "target_updates": self._target_updates}

    def load_extra_state(self, state: dict) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self._target_updates = int(state["target_updates"])


class QLearningGymModule(_EpsilonGreedy):
    """Tabular Q-learning (Watkins 1989) on an environment with Discrete observations and actions (FrozenLake,
    Taxi, CliffWalking): a table of action values, updated after every environment step towards
    ``r + gamma * max_a' Q(s', a')``."""

    algorithm = "qlearning"

    def __init__(
        self,
        env: EnvSpec = EnvSpec(id="FrozenLake-v1"),
        total_steps: int = 20_000,
        learning_rate: float = 0.1,
        gamma: float = 0.99,
        steps_per_iteration: int = 100,
        init_value: float = 0.0,
        exploration: Exploration = Exploration(initial=1.0, final=0.05, fraction=0.5),
        evaluation: EpisodeEvaluation = EpisodeEvaluation(),
    ):
        """
        Args:
            env: The environment (Discrete observations and actions); the default is the slippery FrozenLake 4x4
                (``configs/gym/qlearning-frozenlake.yaml`` sets ``kwargs: {is_slippery: false}``).
            total_steps: Environment steps to train for.
            learning_rate: The step size alpha of each update.
            gamma: Discount factor.
            steps_per_iteration: Vector steps per iteration (one logged row at most).
            init_value: Initial value of every table entry (above 0 explores optimistically).
            exploration: Epsilon-greedy schedule.
            evaluation: Held-out evaluation episodes (greedy).
        """
        super().__init__(env, total_steps, evaluation, torch.optim.SGD, "constant", None)
        self.num_actions = require_discrete_actions(self.env, self.action_space, "Q-learning")
        for name, value, ok, expected in (
            ("learning_rate", learning_rate, learning_rate > 0, "> 0"),
            ("gamma", gamma, 0.0 <= gamma <= 1.0, "a value in [0, 1]"),
            ("steps_per_iteration", steps_per_iteration, steps_per_iteration >= 1, ">= 1"),
        ):
            if not ok:
                raise AlignConfigError(f"model.{name}: expected {expected}, got {value!r}")
        self.learning_rate, self.gamma, self.steps_per_iteration = learning_rate, gamma, steps_per_iteration
        self.exploration = as_group(Exploration, exploration)
        self.q = QTable(self.observation_space, self.num_actions, init_value, self.env.id)

    def configure_optimizers(self):
        return torch.optim.SGD(self.q.parameters(), lr=self.learning_rate)

    def _learn(self, transition: Transition) -> None:
        with torch.enable_grad():
            q = self.q(transition.observations).gather(1, transition.actions.long().view(-1, 1)).squeeze(1)
            with torch.no_grad():
                targets = td_targets(
                    transition.rewards, self.q(transition.next_observations), transition.terminated, self.gamma
                )
            loss = 0.5 * (q - targets).square().sum()
            self.optimizer_step(loss)
        self._errors.append(float((targets - q.detach()).abs().mean()))

    def iteration(self) -> Metrics:
        epsilon = self.epsilon()
        self._errors: list[float] = []
        self.collect(self.explorer(self.steps_per_iteration), self.steps_per_iteration, on_step=self._learn)
        return {"rollout/epsilon": epsilon, "train/td_error": sum(self._errors) / len(self._errors)}


__all__ = ["DQNGymModule", "QLearningGymModule"]

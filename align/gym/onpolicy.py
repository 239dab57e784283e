"""On-policy classic RL on Gymnasium: PPO, A2C and REINFORCE with a baseline, on one actor-critic network.

All three take their losses from the pure layer the language-model algorithms use: PPO the clipped surrogate of
:func:`~align.core.policy_losses.ppo_policy_loss`; A2C and REINFORCE, which update right after sampling, the plain
policy gradient :func:`~align.core.policy_losses.policy_gradient_loss` (``-A log pi``, the surrogate's gradient at ratio
1 with fewer operations); all three :func:`~align.core.losses.value_loss`, and :func:`~align.core.masks.masked_whiten`
for advantages. Each action is one "token", every one valid: ``(B,)`` tensors with ``mask=None``. Advantages come
from :func:`~align.gym.returns.step_gae` (PPO, A2C) or :func:`~align.gym.returns.discounted_returns` (REINFORCE).

The settings are the option groups of the language-model modules where the meaning is the same (``gae``, ``clip``,
``value``, ``updates``, ``entropy_coef``; :mod:`align.gym.options`). Departures from Stable-Baselines3 (whose
defaults the shipped configs otherwise follow):

* :func:`~align.core.losses.value_loss` is ``0.5 * (V - R)^2`` and SB3's is ``(V - R)^2``, so ``value.coef: 1.0`` here
  is SB3's ``vf_coef: 0.5``.
* Observation statistics (``normalize_observations``) are updated after each iteration's update, from that
  iteration's observations, so the log-probs of the update are those the rollout sampled with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from lightning.pytorch.cli import OptimizerCallable

from align.core.losses import value_loss
from align.core.masks import masked_whiten
from align.core.policy_losses import policy_gradient_loss, ppo_policy_loss
from align.core.stats import explained_variance
from align.errors import AlignConfigError
from align.gym.base import ClassicRLModule, Metrics
from align.gym.make import EnvSpec
from align.gym.networks import ActorCritic, RewardScaler
from align.gym.options import (
    EpisodeEvaluation,
    GymClipRange,
    GymGAE,
    GymUpdates,
    GymValueTraining,
    Network,
    Schedule,
    as_group,
)
from align.gym.returns import discounted_returns, step_gae
from align.gym.runner import Steps


class OnPolicyModule(ClassicRLModule):
    """Actor-critic collection and the shared loss; subclasses choose the advantages and how many updates."""

    def __init__(
        self,
        env: EnvSpec = EnvSpec(),
        total_steps: int = 100_000,
        steps_per_iteration: int = 128,
        gae: GymGAE = GymGAE(),
        entropy_coef: float = 0.0,
        value: GymValueTraining = GymValueTraining(),
        updates: GymUpdates = GymUpdates(),
        normalize_observations: bool = False,
        normalize_rewards: bool = False,
        network: Network = Network(),
        evaluation: EpisodeEvaluation = EpisodeEvaluation(),
        optimizer: OptimizerCallable = torch.optim.Adam,
        lr_schedule: Schedule = "constant",
    ):
        """
        Args:
            env: The environment (an id, or ``{id, num_envs, vectorization, kwargs, max_episode_steps, seed}``).
            total_steps: Environment steps to train for, over all environments.
            steps_per_iteration: Vector steps per iteration: each iteration learns from ``steps_per_iteration *
                env.num_envs`` transitions.
            gae: Discount, lambda (1: n-step returns bootstrapped at the window's end) and advantage whitening.
            entropy_coef: Weight of the entropy bonus (subtracted from the loss); 0: none.
            value: Weight of the value loss ``0.5 * (V - R)^2`` (Stable-Baselines3's ``vf_coef`` times 2) and PPO's
                value clipping.
            updates: Epochs, minibatch size, gradient clipping and PPO's KL early stop.
            normalize_observations: Normalise observations by running mean and standard deviation.
            normalize_rewards: Divide rewards by the running standard deviation of the discounted return (the
                logged episode returns stay unscaled).
            network: Hidden sizes, activation, shared trunk.
            evaluation: Held-out evaluation episodes.
            optimizer: Optimizer over the network's parameters (learning rate and all).
            lr_schedule: ``constant``, or ``linear`` decay to 0 at ``total_steps``.
        """
        gae, value, updates = as_group(GymGAE, gae), as_group(GymValueTraining, value), as_group(GymUpdates, updates)
        super().__init__(env, total_steps, evaluation, optimizer, lr_schedule, updates.max_grad_norm)
        if steps_per_iteration < 1:
            raise AlignConfigError(f"model.steps_per_iteration: expected >= 1, got {steps_per_iteration}")
        if entropy_coef < 0:
            raise AlignConfigError(f"model.entropy_coef: expected >= 0, got {entropy_coef}")
        network = as_group(Network, network)
        self.steps_per_iteration, self.gae, self.entropy_coef = steps_per_iteration, gae, entropy_coef
        self.value, self.updates = value, updates
        self.network = ActorCritic(
            self.observation_space,
            self.action_space,
            network.hidden,
            network.activation,
            network.shared,
            normalize_observations,
            network.log_std_init,
            self.env.id,
        )
        self.reward_scaler = RewardScaler(self.env.num_envs, gae.gamma) if normalize_rewards else None

    def _one_update_per_rollout(self, name: str) -> None:
        """A2C and REINFORCE take one optimizer step on the whole rollout, right after sampling: the ``updates``
        fields that split or repeat it, and value clipping around the rollout's values, do not apply."""
        for key, got, expected in (
            ("updates.epochs", self.updates.epochs, 1),
            ("updates.minibatch_size", self.updates.minibatch_size, None),
            ("updates.target_kl", self.updates.target_kl, None),
            ("value.clip", self.value.clip, None),
        ):
            if got != expected:
                raise AlignConfigError(
                    f"model.{key}: expected {'null' if expected is None else expected} ({name} "
                    f"takes one optimizer step per rollout, right after sampling), got {got!r}"
                )

    # ------------------------------------------------------------------ acting
    def act(self, obs: torch.Tensor, deterministic: bool) -> torch.Tensor:
        return self.network.env_actions(self.network.act(obs, deterministic).actions)

    records_logprobs = True
    """Whether the rollout records the sampled actions' log-probs (PPO's old log-probs); A2C and REINFORCE
    update right after sampling and recompute them."""

    @torch.no_grad()
    def sample_actions(self, obs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = self.network.act(obs, logprobs=self.records_logprobs)
        extras = {"values": out.values}
        if self.records_logprobs:
            assert out.logprobs is not None  # asked for above
            extras["logprobs"] = out.logprobs
        if self.network.continuous:
            extras["env_actions"] = self.network.env_actions(out.actions)
        return out.actions, extras

    def rollout(self) -> Steps:
        return self.scaled(self.collect(self.sample_actions, self.steps_per_iteration))

    def scaled(self, steps: Steps) -> Steps:
        """``steps`` with its rewards scaled when ``normalize_rewards`` (the runner's episode returns are not)."""
        if self.reward_scaler is not None:
            steps.rewards = self.reward_scaler(steps.rewards, steps.done)
        return steps

    @torch.no_grad()
    def next_values(self, steps: Steps) -> torch.Tensor:
        """``V(s_{t+1})`` for every step, ``(T, N)`` (the final observation's value where an episode ended)."""
        t, n = steps.shape
        return self.network.value(steps.next_observations.flatten(0, 1)).view(t, n)

    def update_statistics(self, observations: torch.Tensor) -> None:
        """Fold the iteration's observations into the running statistics, after its update (module docstring);
        inside the training step, so the step's checkpoint holds them."""
        self.network.encoder.update(observations.flatten(0, -1 - len(self.observation_space.shape or ())))

    # ------------------------------------------------------------------ loss
    def loss(
        self,
        obs: torch.Tensor,
        actions: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        returns: torch.Tensor,
        old_values: torch.Tensor,
        clip_low: float = 0.2,
        clip_high: float | None = None,
        value_clip: float | None = None,
        value_coef: float | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The actor-critic loss of ``B`` transitions (every argument ``(B,)`` but ``obs``/``actions``).
        ``old_logprobs=None``: the plain policy gradient :func:`~align.core.policy_losses.policy_gradient_loss`, for an
        update made right after sampling (A2C, REINFORCE); otherwise PPO's clipped surrogate."""
        logprobs, entropy, values = self.network.evaluate(obs, actions, entropy_grad=self.entropy_coef != 0)
        # Each row is one action, every one valid: the masked functions run with mask=None.
        if self.gae.whiten_advantages:
            advantages = masked_whiten(advantages, None)
        if old_logprobs is None:
            policy_loss, stats = policy_gradient_loss(logprobs, advantages, None), None
        else:
            policy_loss, stats = ppo_policy_loss(
                logprobs, old_logprobs, advantages, None, clip_low=clip_low, clip_high=clip_high
            )
        v_loss, _ = value_loss(values, old_values, returns, None, clip=value_clip)
        entropy = entropy.mean()
        value_coef = self.value.coef if value_coef is None else value_coef
        loss = policy_loss + value_coef * v_loss - self.entropy_coef * entropy
        metrics = {
            "train/loss": loss.detach(),
            "train/policy_loss": policy_loss.detach(),
            "train/value_loss": v_loss.detach(),
            "train/entropy": entropy.detach(),
        }
        if stats is not None:
            metrics.update({"train/clipfrac": stats.clipfrac, "train/approx_kl": stats.approx_kl})
        return loss, metrics

    @staticmethod
    def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> Callable[[], float]:
        """:func:`align.core.stats.explained_variance` of ``(B,)`` values, as a float computed when logged."""
        return lambda: float(explained_variance(values, returns, torch.ones_like(returns, dtype=torch.bool)))

    @staticmethod
    def means(history: list[dict[str, torch.Tensor]]) -> Metrics:
        """Each metric's mean over the iteration's minibatches, computed when logged."""

        def mean(k: str) -> Callable[[], float]:
            return lambda: float(torch.stack([h[k] for h in history]).mean())

        return {k: mean(k) for k in history[0]}


class PPOGymModule(OnPolicyModule):
    """PPO (Schulman et al. 2017, arXiv 1707.06347) on a Gymnasium environment: ``updates.epochs`` passes over each
    rollout in minibatches of ``updates.minibatch_size`` transitions, clipped surrogate, GAE, optional value
    clipping and entropy bonus.

    ``python recipes/gym.py`` trains it on CartPole-v1 with RL Zoo's tuned settings (``configs/gym/ppo-cartpole.yaml``).
    """

    algorithm = "ppo"

    def __init__(
        self,
        updates: GymUpdates = GymUpdates(epochs=10, minibatch_size=64),
        clip: GymClipRange = GymClipRange(),
        **kwargs,
    ):
        """
        Args:
            updates: Passes over each rollout (default 10), transitions per minibatch (default 64; one optimizer
                step each), gradient clipping, and ``target_kl``, which stops an iteration's epochs early.
            clip: Clip range of the probability ratio (``low``; ``high``: null for symmetric) and its schedule
                (``linear``: falling to 0 at ``total_steps``).
            **kwargs: :class:`OnPolicyModule`'s arguments (environment, budget, ``steps_per_iteration``, ``gae``,
                ``entropy_coef``, ``value``, network, optimizer).
        """
        super().__init__(updates=updates, **kwargs)
        self.clip = as_group(GymClipRange, clip)

    def clip_ranges(self) -> tuple[float, float | None]:
        """The current ``(low, high)`` clip ranges (``high`` None: equal to ``low``), after the schedule."""
        scale = 1.0 - self.progress() if self.clip.schedule == "linear" else 1.0
        high = None if self.clip.high is None else max(self.clip.high * scale, 1e-8)
        return max(self.clip.low * scale, 1e-8), high

    def iteration(self) -> Metrics:
        steps = self.rollout()
        old_values = steps.extras["values"]
        advantages, returns = step_gae(
            steps.rewards,
            old_values,
            self.next_values(steps),
            steps.terminated,
            steps.done,
            self.gae.gamma,
            self.gae.lam,
        )
        obs, actions = steps.observations.flatten(0, 1), steps.actions.flatten(0, 1)
        old_logprobs, old_values = steps.extras["logprobs"].flatten(), old_values.flatten()
        advantages, returns = advantages.flatten(), returns.flatten()
        low, high = self.clip_ranges()
        minibatch_size, target_kl = self.updates.minibatch_size or len(obs), self.updates.target_kl
        history = []
        with torch.enable_grad():
            for _ in range(self.updates.epochs):
                for index in torch.randperm(len(obs)).split(minibatch_size):
                    loss, metrics = self.loss(
                        obs[index],
                        actions[index],
                        old_logprobs[index],
                        advantages[index],
                        returns[index],
                        old_values[index],
                        low,
                        high,
                        self.value.clip,
                    )
                    self.optimizer_step(loss)
                    history.append(metrics)
                if target_kl is not None and float(history[-1]["train/approx_kl"]) > 1.5 * target_kl:
                    break
        self.update_statistics(obs)
        out = self.means(history)
        out["train/explained_variance"] = self.explained_variance(old_values, returns)
        out["train/clip_range"] = low
        return out


class A2CGymModule(OnPolicyModule):
    """A2C, the synchronous advantage actor-critic (Mnih et al. 2016, arXiv 1602.01783): one update per short
    rollout of ``steps_per_iteration`` vector steps, n-step returns (``gae.lam: 1``) or GAE, an entropy bonus, a
    shared trunk or separate networks. SB3's A2C uses RMSprop (``configs/gym/a2c-cartpole.yaml``)."""

    algorithm = "a2c"
    records_logprobs = False

    def __init__(self, steps_per_iteration: int = 5, gae: GymGAE = GymGAE(lam=1.0, whiten_advantages=False), **kwargs):
        """Arguments as :class:`OnPolicyModule`'s, with A2C's defaults: 5 steps per update, ``gae.lam: 1`` (the
        n-step return), advantages not whitened; ``updates`` sets only ``max_grad_norm`` (one step per rollout)."""
        super().__init__(steps_per_iteration=steps_per_iteration, gae=gae, **kwargs)
        self._one_update_per_rollout("A2C")

    def iteration(self) -> Metrics:
        steps = self.rollout()
        values = steps.extras["values"]
        advantages, returns = step_gae(
            steps.rewards, values, self.next_values(steps), steps.terminated, steps.done, self.gae.gamma, self.gae.lam
        )
        with torch.enable_grad():
            loss, metrics = self.loss(
                steps.observations.flatten(0, 1),
                steps.actions.flatten(0, 1),
                None,
                advantages.flatten(),
                returns.flatten(),
                values.flatten(),
            )
            self.optimizer_step(loss)
        self.update_statistics(steps.observations)
        out = self.means([metrics])
        out["train/explained_variance"] = self.explained_variance(values.flatten(), returns.flatten())
        return out


class REINFORCEGymModule(OnPolicyModule):
    """REINFORCE (Williams 1992) with a learned state-value baseline: each iteration plays one complete episode
    per environment and follows ``(G_t - V(s_t)) grad log pi(a_t | s_t)``, with ``G_t`` the discounted return to
    the episode's end (:func:`~align.gym.returns.discounted_returns`). ``baseline: none`` uses ``G_t`` itself.

    Every environment plays exactly one episode per iteration, from a fresh reset (see
    :meth:`~align.gym.runner.EnvRunner.collect_episodes`): keeping the first episodes to end would favour short
    ones."""

    algorithm = "reinforce"
    records_logprobs = False

    def __init__(self, baseline: Literal["value", "none"] = "value", gae: GymGAE = GymGAE(lam=1.0), **kwargs):
        """
        Args:
            baseline: ``value``: subtract a learned ``V(s)`` (trained on the returns); ``none``: plain REINFORCE.
            gae: The discount and advantage whitening; ``lam`` is 1, since the returns are Monte-Carlo.
            **kwargs: :class:`OnPolicyModule`'s arguments, but ``steps_per_iteration`` (an iteration is one episode
                per environment); ``updates`` sets only ``max_grad_norm`` (one step per iteration).
        """
        super().__init__(steps_per_iteration=1, gae=gae, **kwargs)
        if self.gae.lam != 1.0:
            raise AlignConfigError(
                f"model.gae.lam: expected 1 (REINFORCE's returns are Monte-Carlo, to the episode's "
                f"end; A2C takes other values), got {self.gae.lam!r}"
            )
        if baseline not in ("value", "none"):
            raise AlignConfigError(f"model.baseline: expected 'value' or 'none', got {baseline!r}")
        self._one_update_per_rollout("REINFORCE")
        self.baseline = baseline

    def rollout(self) -> Steps:
        return self.scaled(self.collect(self.sample_actions, None))

    def iteration(self) -> Metrics:
        steps = self.rollout()
        returns = discounted_returns(steps.rewards, steps.done, self.gae.gamma)  # (T, N)
        valid = steps.valid
        values = steps.extras["values"]
        advantages = returns - values if self.baseline == "value" else returns
        value_coef = self.value.coef if self.baseline == "value" else 0.0
        with torch.enable_grad():
            loss, metrics = self.loss(
                steps.observations[valid],
                steps.actions[valid],
                None,
                advantages[valid],
                returns[valid],
                values[valid],
                value_coef=value_coef,
            )
            self.optimizer_step(loss)
        self.update_statistics(steps.observations[valid])
        out = self.means([metrics])
        if self.baseline == "value":
            out["train/explained_variance"] = self.explained_variance(values[valid], returns[valid])
        return out


__all__ = ["A2CGymModule", "OnPolicyModule", "PPOGymModule", "REINFORCEGymModule"]

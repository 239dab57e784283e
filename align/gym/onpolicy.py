"""On-policy classic RL on Gymnasium: PPO, A2C and REINFORCE with a baseline, on one actor-critic network.

All three take their losses from the pure layer the language-model algorithms use: PPO the clipped surrogate of
:func:`~align.core.policy_losses.ppo_policy_loss`; A2C and REINFORCE, which update right after sampling, the plain policy
gradient :func:`~align.core.policy_losses.policy_gradient_loss` (``-A log pi``, the surrogate's gradient at ratio 1 with
fewer operations); all three :func:`~align.core.losses.value_loss`, and :func:`~align.core.masks.masked_whiten` for
advantages. Each action is one "token", every one valid: ``(B,)`` tensors with ``mask=None``. Advantages come
from :func:`~align.gym.returns.step_gae` (PPO, A2C) or :func:`~align.gym.returns.discounted_returns` (REINFORCE).

Departures from Stable-Baselines3 (whose defaults the shipped configs otherwise follow):

* :func:`~align.core.losses.value_loss` is ``0.5 * (V - R)^2`` and SB3's is ``(V - R)^2``, so ``vf_coef: 1.0`` here is
  SB3's ``vf_coef: 0.5``.
* Observation statistics (``normalize_observations``) are updated after each iteration's update, from that
  iteration's observations, so the log-probs of the update are those the rollout sampled with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch
from lightning.pytorch.cli import OptimizerCallable

from align.gym.returns import discounted_returns, step_gae
from align.gym.make import EnvSpec
from align.gym.runner import Steps
from align.errors import AlignConfigError
from align.core.masks import masked_whiten
from align.core.losses import value_loss
from align.core.policy_losses import policy_gradient_loss, ppo_policy_loss
from align.core.stats import explained_variance
from align.gym.networks import Activation, ActorCritic, RewardScaler
from align.gym.base import ClassicRLModule, Evaluation, Metrics


@dataclass(frozen=True)
class Network:
    """The actor-critic network."""

    hidden: tuple[int, ...] = (64, 64)
    """Hidden layer widths."""
    activation: Activation = "tanh"
    """``tanh`` or ``relu``."""
    shared: bool = False
    """One trunk for policy and value (two heads) instead of two separate networks."""
    log_std_init: float = 0.0
    """Initial log standard deviation of a continuous-action policy."""


class OnPolicyModule(ClassicRLModule):
    """Actor-critic collection and the shared loss; subclasses choose the advantages and how many updates."""

    def __init__(
        self,
        env: EnvSpec = EnvSpec(),
        total_steps: int = 100_000,
        n_steps: int = 128,
        gamma: float = 0.99,
        gae_lambda: float = 0.95,
        ent_coef: float = 0.0,
        vf_coef: float = 1.0,
        normalize_advantages: bool = True,
        normalize_observations: bool = False,
        normalize_rewards: bool = False,
        network: Network = Network(),
        evaluation: Evaluation = Evaluation(),
        optimizer: OptimizerCallable = torch.optim.Adam,
        lr_schedule: Literal["constant", "linear"] = "constant",
        max_grad_norm: float | None = 0.5,
    ):
        """
        Args:
            env: The environment (an id, or ``{id, num_envs, vectorization, kwargs, max_episode_steps, seed}``).
            total_steps: Environment steps to train for, over all environments.
            n_steps: Vector steps per iteration: each iteration learns from ``n_steps * env.num_envs`` transitions.
            gamma: Discount factor.
            gae_lambda: GAE's lambda; 1 gives n-step returns bootstrapped at the window's end.
            ent_coef: Weight of the entropy bonus.
            vf_coef: Weight of the value loss ``0.5 * (V - R)^2`` (SB3's ``vf_coef`` times 2).
            normalize_advantages: Whiten the advantages of each minibatch.
            normalize_observations: Normalise observations by running mean and standard deviation.
            normalize_rewards: Divide rewards by the running standard deviation of the discounted return (the
                logged episode returns stay unscaled).
            network: Hidden sizes, activation, shared trunk.
            evaluation: Held-out evaluation episodes.
            optimizer: Optimizer over the network's parameters (learning rate and all).
            lr_schedule: ``constant``, or ``linear`` decay to 0 at ``total_steps``.
            max_grad_norm: Clip the gradient's global norm to this; null: no clipping.
        """
        super().__init__(env, total_steps, evaluation, optimizer, lr_schedule, max_grad_norm)
        if n_steps < 1:
            raise AlignConfigError(f"model.n_steps: expected >= 1, got {n_steps}")
        if not 0.0 <= gamma <= 1.0 or not 0.0 <= gae_lambda <= 1.0:
            raise AlignConfigError(f"model.gamma and model.gae_lambda: expected values in [0, 1], got {gamma} and "
                                   f"{gae_lambda}")
        network = Network(**network) if isinstance(network, dict) else network
        self.n_steps, self.gamma, self.gae_lambda = n_steps, gamma, gae_lambda
        self.ent_coef, self.vf_coef, self.normalize_advantages = ent_coef, vf_coef, normalize_advantages
        self.network = ActorCritic(self.observation_space, self.action_space, network.hidden, network.activation,
                                   network.shared, normalize_observations, network.log_std_init, self.env.id)
        self.reward_scaler = RewardScaler(self.env.num_envs, gamma) if normalize_rewards else None

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
            extras["logprobs"] = out.logprobs
        if self.network.continuous:
            extras["env_actions"] = self.network.env_actions(out.actions)
        return out.actions, extras

    def rollout(self) -> Steps:
        return self.scaled(self.collect(self.sample_actions, self.n_steps))

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
    def loss(self, obs: torch.Tensor, actions: torch.Tensor, old_logprobs: torch.Tensor | None,
             advantages: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, clip: float = 0.2,
             clip_value: float | None = None, vf_coef: float | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The actor-critic loss of ``B`` transitions (every argument ``(B,)`` but ``obs``/``actions``).
        ``old_logprobs=None``: the plain policy gradient :func:`~align.core.policy_losses.policy_gradient_loss`, for an update
        made right after sampling (A2C, REINFORCE); otherwise PPO's clipped surrogate."""
        logprobs, entropy, values = self.network.evaluate(obs, actions, entropy_grad=self.ent_coef != 0)
        # Each row is one action, every one valid: the masked functions run with mask=None.
        if self.normalize_advantages:
            advantages = masked_whiten(advantages, None)
        if old_logprobs is None:
            policy_loss, stats = policy_gradient_loss(logprobs, advantages, None), None
        else:
            policy_loss, stats = ppo_policy_loss(logprobs, old_logprobs, advantages, None, clip_low=clip)
        v_loss, _ = value_loss(values, old_values, returns, None, clip=clip_value)
        entropy = entropy.mean()
        vf_coef = self.vf_coef if vf_coef is None else vf_coef
        loss = policy_loss + vf_coef * v_loss - self.ent_coef * entropy
        metrics = {"train/loss": loss.detach(), "train/policy_loss": policy_loss.detach(),
                   "train/value_loss": v_loss.detach(), "train/entropy": entropy.detach()}
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
        return {k: (lambda k=k: float(torch.stack([h[k] for h in history]).mean())) for k in history[0]}


class PPOGymModule(OnPolicyModule):
    """PPO (Schulman et al. 2017, arXiv 1707.06347) on a Gymnasium environment: ``n_epochs`` passes over each
    rollout in ``batch_size`` minibatches, clipped surrogate, GAE, optional value clipping and entropy bonus.

    ``python recipes/gym.py`` trains it on CartPole-v1 with RL Zoo's tuned settings (``configs/gym/ppo-cartpole.yaml``).
    """

    algorithm = "ppo"

    def __init__(
        self,
        batch_size: int = 64,
        n_epochs: int = 10,
        clip_range: float = 0.2,
        clip_range_vf: float | None = None,
        target_kl: float | None = None,
        clip_schedule: Literal["constant", "linear"] = "constant",
        **kwargs,
    ):
        """
        Args:
            batch_size: Transitions per minibatch (one optimizer step each).
            n_epochs: Passes over each rollout.
            clip_range: Clip range of the probability ratio.
            clip_range_vf: Clip range of the value around its rollout value; null: unclipped.
            target_kl: Stop an iteration's epochs early once the approximate KL exceeds 1.5 times this; null: never.
            clip_schedule: ``linear``: ``clip_range`` falls linearly to 0 at ``total_steps``.
            **kwargs: :class:`OnPolicyModule`'s arguments (environment, budget, ``n_steps``, discounting, losses,
                network, optimizer).
        """
        super().__init__(**kwargs)
        if batch_size < 1 or n_epochs < 1 or not clip_range > 0:
            raise AlignConfigError(f"model.batch_size, model.n_epochs, model.clip_range: expected >= 1, >= 1 and > 0, "
                                   f"got {batch_size}, {n_epochs}, {clip_range}")
        self.batch_size, self.n_epochs, self.clip_range = batch_size, n_epochs, clip_range
        self.clip_range_vf, self.target_kl, self.clip_schedule = clip_range_vf, target_kl, clip_schedule

    def iteration(self) -> Metrics:
        steps = self.rollout()
        old_values = steps.extras["values"]
        advantages, returns = step_gae(steps.rewards, old_values, self.next_values(steps), steps.terminated,
                                       steps.done, self.gamma, self.gae_lambda)
        obs, actions = steps.observations.flatten(0, 1), steps.actions.flatten(0, 1)
        old_logprobs, old_values = steps.extras["logprobs"].flatten(), old_values.flatten()
        advantages, returns = advantages.flatten(), returns.flatten()
        clip = self.clip_range * (1.0 - self.progress() if self.clip_schedule == "linear" else 1.0)
        clip = max(clip, 1e-8)
        history = []
        with torch.enable_grad():
            for _ in range(self.n_epochs):
                for index in torch.randperm(len(obs)).split(self.batch_size):
                    loss, metrics = self.loss(obs[index], actions[index], old_logprobs[index], advantages[index],
                                              returns[index], old_values[index], clip, self.clip_range_vf)
                    self.optimizer_step(loss)
                    history.append(metrics)
                if self.target_kl is not None and float(history[-1]["train/approx_kl"]) > 1.5 * self.target_kl:
                    break
        self.update_statistics(obs)
        out = self.means(history)
        out["train/explained_variance"] = self.explained_variance(old_values, returns)
        out["train/clip_range"] = clip
        return out


class A2CGymModule(OnPolicyModule):
    """A2C, the synchronous advantage actor-critic (Mnih et al. 2016, arXiv 1602.01783): one update per short
    rollout of ``n_steps`` vector steps, n-step returns (``gae_lambda: 1``) or GAE, an entropy bonus, a shared
    trunk or separate networks. SB3's A2C uses RMSprop (``configs/gym/a2c-cartpole.yaml``)."""

    algorithm = "a2c"
    records_logprobs = False

    def __init__(self, n_steps: int = 5, gae_lambda: float = 1.0, normalize_advantages: bool = False, **kwargs):
        """Arguments as :class:`OnPolicyModule`'s, with A2C's defaults: 5 steps per update, ``gae_lambda: 1``
        (the n-step return), advantages not whitened."""
        super().__init__(n_steps=n_steps, gae_lambda=gae_lambda, normalize_advantages=normalize_advantages, **kwargs)

    def iteration(self) -> Metrics:
        steps = self.rollout()
        values = steps.extras["values"]
        advantages, returns = step_gae(steps.rewards, values, self.next_values(steps), steps.terminated, steps.done,
                                       self.gamma, self.gae_lambda)
        with torch.enable_grad():
            loss, metrics = self.loss(steps.observations.flatten(0, 1), steps.actions.flatten(0, 1), None,
                                      advantages.flatten(), returns.flatten(), values.flatten())
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

    def __init__(self, baseline: Literal["value", "none"] = "value", **kwargs):
        """
        Args:
            baseline: ``value``: subtract a learned ``V(s)`` (trained on the returns); ``none``: plain REINFORCE.
            **kwargs: :class:`OnPolicyModule`'s arguments, but ``n_steps`` and ``gae_lambda``: an iteration is one
                episode per environment, and its returns are Monte-Carlo.
        """
        super().__init__(n_steps=1, gae_lambda=1.0, **kwargs)
        if baseline not in ("value", "none"):
            raise AlignConfigError(f"model.baseline: expected 'value' or 'none', got {baseline!r}")
        self.baseline = baseline

    def rollout(self) -> Steps:
        return self.scaled(self.collect(self.sample_actions, None))

    def iteration(self) -> Metrics:
        steps = self.rollout()
        returns = discounted_returns(steps.rewards, steps.done, self.gamma)  # (T, N)
        valid = steps.valid
        values = steps.extras["values"]
        advantages = returns - values if self.baseline == "value" else returns
        vf_coef = self.vf_coef if self.baseline == "value" else 0.0
        with torch.enable_grad():
            loss, metrics = self.loss(steps.observations[valid], steps.actions[valid], None, advantages[valid],
                                      returns[valid], values[valid], vf_coef=vf_coef)
            self.optimizer_step(loss)
        self.update_statistics(steps.observations[valid])
        out = self.means([metrics])
        if self.baseline == "value":
            out["train/explained_variance"] = self.explained_variance(values[valid], returns[valid])
        return out


__all__ = ["A2CGymModule", "Network", "OnPolicyModule", "PPOGymModule", "REINFORCEGymModule"]

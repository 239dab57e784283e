"""The on-policy classic-RL modules (align.gym.onpolicy): A2C's and REINFORCE's loss is the plain policy gradient,
PPO on continuous actions clips what the environment gets, and PPO's and A2C's updates equal Stable-Baselines3's.

Against Stable-Baselines3 (the dev extra; those tests skip without it), from the same weights on the same rollout:
both libraries are given one network (align's weights copied into SB3's policy) and one window of CartPole steps
(collected by align). SB3's rollout buffer receives it the way its ``collect_rollouts`` fills it (a time-limit
truncation adds ``gamma * V(final observation)`` to the reward), and each side then takes its own update: PPO's 20
epochs of one 256-transition minibatch, A2C's single RMSprop step. The values, log-probs, advantages, returns and
the parameters after the update agree to float rounding. A2C stays equal over twenty consecutive windows, with
RMSprop's running averages carried from step to step; and given one torch RNG state and the same episode seeds, its
collection draws the same actions as SB3's, window after window. So two runs of one seed differ in the random
numbers each library draws, not in the algorithm.
"""

from __future__ import annotations

from functools import partial

import lightning as L
import numpy as np
import pytest
import torch
from _gym import cpu_trainer

from align.gym import A2CGymModule, GymClipRange, GymGAE, GymUpdates, GymValueTraining, Network, PPOGymModule
from align.gym.make import EnvSpec
from align.gym.returns import step_gae

CARTPOLE = EnvSpec(id="CartPole-v1", num_envs=2)
ADAM = partial(torch.optim.Adam, lr=1e-3)


def test_policy_gradient_loss_is_minus_advantage_times_log_prob():
    """A2C and REINFORCE take the plain policy gradient: the loss is -mean(A * log pi), with its gradient, and no
    clipping statistics (there is no ratio)."""
    torch.manual_seed(0)
    module = A2CGymModule(env=CARTPOLE, entropy_coef=0.0, value=GymValueTraining(coef=0.0))
    obs, actions = torch.randn(6, 4), torch.tensor([0, 1, 1, 0, 1, 0])
    advantages = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0, 0.25])
    zeros = torch.zeros(6)
    loss, metrics = module.loss(obs, actions, None, advantages, zeros, zeros)
    logprobs, _, _ = module.network.evaluate(obs, actions)
    assert float(metrics["train/policy_loss"]) == pytest.approx(-float((advantages * logprobs.detach()).mean()))
    assert "train/clipfrac" not in metrics and "train/approx_kl" not in metrics
    params = list(module.network.parameters())
    grads = torch.autograd.grad(loss, params)
    reference = torch.autograd.grad(-(advantages * logprobs).mean(), params, allow_unused=True)
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, torch.zeros_like(got) if want is None else want)


def test_ppo_on_continuous_actions_clips_what_the_environment_gets():
    torch.manual_seed(0)
    module = PPOGymModule(
        env=EnvSpec(id="Pendulum-v1", num_envs=2),
        total_steps=64,
        steps_per_iteration=16,
        updates=GymUpdates(epochs=1, minibatch_size=32),
        network={"log_std_init": 1.0},
        optimizer=ADAM,
    )
    obs = module.runner.start()
    actions, extras = module.sample_actions(obs)
    assert actions.shape == (2, 1) and extras["logprobs"].shape == (2,)
    assert float(extras["env_actions"].abs().max()) <= 2.0  # Pendulum's torque bound
    cpu_trainer(max_epochs=1).fit(module)
    assert module.env_steps >= 64 and "train/entropy" in module.last_metrics
    assert len(module.evaluate(episodes=2)) == 2


NUM_ENVS = 8


def _align(algo: str):
    network = Network(hidden=(64, 64), activation="tanh", shared=False)
    # A 12-step time limit: the windows hold truncations (bootstrapped) as well as terminations.
    env = EnvSpec(id="CartPole-v1", num_envs=NUM_ENVS, seed=3, max_episode_steps=12)
    if algo == "ppo":
        module = PPOGymModule(
            env=env,
            total_steps=100_000,
            steps_per_iteration=32,
            gae=GymGAE(gamma=0.98, lam=0.8, whiten_advantages=True),
            entropy_coef=0.0,
            value=GymValueTraining(coef=1.0),
            clip=GymClipRange(low=0.2),
            updates=GymUpdates(epochs=20, minibatch_size=256, max_grad_norm=0.5),
            network=network,
            optimizer=lambda params: torch.optim.Adam(params, lr=1e-3, eps=1e-5),
        )
    else:
        module = A2CGymModule(
            env=env,
            total_steps=100_000,
            steps_per_iteration=5,
            gae=GymGAE(gamma=0.99, lam=1.0, whiten_advantages=False),
            entropy_coef=0.0,
            value=GymValueTraining(coef=1.0),
            updates=GymUpdates(max_grad_norm=0.5),
            network=network,
            optimizer=lambda params: torch.optim.RMSprop(params, lr=7e-4, alpha=0.99, eps=1e-5),
        )
    optimizer = module.configure_optimizers()
    module.optimizers = lambda: optimizer  # the update outside a fit: the raw optimizer
    module.trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return module


def _stable_baselines3():
    """Stable-Baselines3, or a skip where it is not installed."""
    return pytest.importorskip("stable_baselines3")


def _sb3(algo: str):
    sb3 = _stable_baselines3()
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.logger import configure

    common = dict(
        ent_coef=0.0,
        vf_coef=0.5,
        max_grad_norm=0.5,
        device="cpu",
        seed=0,
        policy_kwargs={"net_arch": {"pi": [64, 64], "vf": [64, 64]}, "ortho_init": True},
    )
    env = make_vec_env("CartPole-v1", n_envs=NUM_ENVS, seed=0)
    if algo == "ppo":
        model = sb3.PPO(
            "MlpPolicy",
            env,
            n_steps=32,
            batch_size=256,
            n_epochs=20,
            gamma=0.98,
            gae_lambda=0.8,
            learning_rate=1e-3,
            clip_range=0.2,
            normalize_advantage=True,
            **common,
        )
    else:
        model = sb3.A2C(
            "MlpPolicy",
            env,
            n_steps=5,
            gamma=0.99,
            gae_lambda=1.0,
            learning_rate=7e-4,
            use_rms_prop=True,
            rms_prop_eps=1e-5,
            normalize_advantage=False,
            **common,
        )
    model.set_logger(configure(None, []))
    model._current_progress_remaining = 1.0
    return model


def _pairs(module, model):
    """(align tensor, SB3 parameter) pairs: the stacked MLP's policy head (0) and value head (1), in SB3's layout."""
    weights, biases = list(module.network.nets.weights), list(module.network.nets.biases)
    policy = model.policy
    hidden = [(policy.mlp_extractor.policy_net, 0), (policy.mlp_extractor.value_net, 1)]
    out = []
    for net, head in hidden:
        for layer, linear in enumerate([net[0], net[2]]):
            out += [(weights[layer][head].T, linear.weight), (biases[layer][head, 0], linear.bias)]
    out += [(weights[2][0].T, policy.action_net.weight), (biases[2][0, 0], policy.action_net.bias)]
    out += [(weights[2][1][:, :1].T, policy.value_net.weight), (biases[2][1, 0, :1], policy.value_net.bias)]
    return out


def _copy_weights(module, model) -> None:
    """Give SB3's policy align's weights."""
    with torch.no_grad():
        for mine, theirs in _pairs(module, model):
            theirs.copy_(mine)


def _sb3_buffer(module, model, steps, episode_start: torch.Tensor) -> torch.Tensor:
    """Fill SB3's rollout buffer with align's window ``steps`` as SB3's ``collect_rollouts`` fills it: a time-limit
    truncation adds ``gamma * V(final observation)`` to the reward; ``episode_start``: the window before ended
    those environments' episodes. Returns align's ``next_values`` of the window."""
    t, n = steps.shape
    flat_obs = steps.observations.flatten(0, 1)
    with torch.no_grad():
        values = model.policy.predict_values(flat_obs).view(t, n)
        logprobs = model.policy.get_distribution(flat_obs).log_prob(steps.actions.flatten()).view(t, n)
    next_values = module.next_values(steps)
    rewards = steps.rewards.clone()
    truncated = steps.done & ~steps.terminated
    rewards[truncated] += module.gae.gamma * next_values[truncated]
    buffer = model.rollout_buffer
    buffer.reset()
    for k in range(t):
        buffer.add(
            steps.observations[k].numpy(),
            steps.actions[k].numpy().reshape(n, 1),
            rewards[k].numpy(),
            episode_start.numpy(),
            values[k].view(n, 1),
            logprobs[k],
        )
        episode_start = steps.done[k]
    buffer.compute_returns_and_advantage(last_values=next_values[-1].view(n, 1), dones=steps.done[-1].numpy())
    return next_values


@pytest.mark.parametrize("algo", ["ppo", "a2c"])
def test_update_equals_stable_baselines3s(algo):
    torch.manual_seed(0)
    module, model = _align(algo), _sb3(algo)
    _copy_weights(module, model)

    steps = module.rollout()
    while not (steps.terminated.any() and (steps.done & ~steps.terminated).any()):  # both kinds of episode end
        steps = module.rollout()
    t, n = steps.shape
    flat_obs = steps.observations.flatten(0, 1)
    with torch.no_grad():
        values = model.policy.predict_values(flat_obs).view(t, n)
        logprobs = model.policy.get_distribution(flat_obs).log_prob(steps.actions.flatten()).view(t, n)
    torch.testing.assert_close(values, steps.extras["values"], rtol=0, atol=1e-6)
    if algo == "ppo":
        torch.testing.assert_close(logprobs, steps.extras["logprobs"], rtol=0, atol=1e-6)

    next_values = _sb3_buffer(module, model, steps, torch.zeros(n, dtype=torch.bool))
    buffer = model.rollout_buffer
    advantages, returns = step_gae(
        steps.rewards,
        steps.extras["values"],
        next_values,
        steps.terminated,
        steps.done,
        module.gae.gamma,
        module.gae.lam,
    )
    np.testing.assert_allclose(buffer.advantages, advantages.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(buffer.returns, returns.numpy(), rtol=0, atol=1e-5)

    before = [mine.detach().clone() for mine, _ in _pairs(module, model)]
    model.train()
    module.rollout = lambda: steps  # the same window for align's update
    module.iteration()
    moved = max(float((mine.detach() - b).abs().max()) for (mine, _), b in zip(_pairs(module, model), before))
    assert moved > 1e-3  # the update changed the network
    for mine, theirs in _pairs(module, model):
        torch.testing.assert_close(mine, theirs.detach(), rtol=0, atol=2e-6)


def test_a2c_stays_equal_to_stable_baselines3s_over_many_windows():
    # Twenty consecutive A2C windows, each collected by align's current policy and learned from by both libraries
    # (RMSprop's running averages carried from step to step): the networks stay equal to float rounding. Over 300
    # windows they stay within about 5e-5, where the rounding settles.
    torch.manual_seed(0)
    module, model = _align("a2c"), _sb3("a2c")
    _copy_weights(module, model)
    collect = module.rollout
    episode_start = torch.zeros(NUM_ENVS, dtype=torch.bool)
    ended = 0
    for _ in range(20):
        steps = collect()
        ended += int(steps.done.sum())
        _sb3_buffer(module, model, steps, episode_start)
        episode_start = steps.done[-1]
        model.train()
        module.rollout = lambda: steps  # noqa: B023
        module.iteration()
    assert ended > 0
    for mine, theirs in _pairs(module, model):
        torch.testing.assert_close(mine, theirs.detach(), rtol=0, atol=1e-6)


def test_a2c_takes_stable_baselines3s_actions_from_the_same_random_state():
    # A whole stretch of training, collection included. align samples an action as argmax(logits - log E) with E
    # exponential noise, which is how torch.multinomial draws one sample for SB3: from one network, one torch RNG
    # state and the same episode seeds, the two A2C runs draw the same numbers and so take the same actions,
    # window after window, for as long as their networks agree. 150 windows: 6,000 environment steps, a few
    # hundred episodes ended by failure or by the time limit.
    _stable_baselines3()
    import gymnasium as gym
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv

    windows = 150
    torch.manual_seed(0)
    module, model = _align("a2c"), _sb3("a2c")
    spec, runner = module.env, module.runner

    class AlignSeeds(gym.Wrapper):  # each reset with the seed align's runner gives that episode
        def __init__(self, index: int):
            super().__init__(Monitor(gym.make(spec.id, max_episode_steps=spec.max_episode_steps)))
            self.index, self.episode = index, 0

        def reset(self, *, seed=None, options=None):
            self.episode += 1
            return self.env.reset(seed=runner.episode_seed(self.index, self.episode - 1), options=options)

    env = DummyVecEnv([lambda i=i: AlignSeeds(i) for i in range(NUM_ENVS)])
    model.set_env(env)
    _copy_weights(module, model)

    played = {"align": [], "sb3": []}
    align_step, sb3_step = runner._step, env.step_async

    def recorded_align_step(actions):
        played["align"].append(actions.copy())
        return align_step(actions)

    def recorded_sb3_step(actions):
        played["sb3"].append(np.asarray(actions).reshape(-1).copy())
        return sb3_step(actions)

    runner._step, env.step_async = recorded_align_step, recorded_sb3_step
    torch.manual_seed(1)
    model.learn(total_timesteps=windows * 5 * NUM_ENVS)
    torch.manual_seed(1)
    for _ in range(windows):
        module.iteration()

    align_actions, sb3_actions = np.stack(played["align"]), np.stack(played["sb3"])
    assert align_actions.shape == sb3_actions.shape == (windows * 5, NUM_ENVS)
    assert runner.episodes > 300
    differ = np.flatnonzero((align_actions != sb3_actions).any(1))
    assert differ.size == 0, f"the actions first differ at vector step {differ[:1]}"
    for mine, theirs in _pairs(module, model):
        torch.testing.assert_close(mine, theirs.detach(), rtol=0, atol=1e-5)

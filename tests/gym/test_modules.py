"""The classic-RL modules on Gymnasium: each trains a few iterations inside a Trainer and logs its metrics, the
policy-gradient modules' loss is the policy gradient, continuous actions work, and unsupported spaces fail on one
line. (Learning to solve CartPole is in tests/e2e/test_gym_learning.py; the math in tests/gym/test_returns.py and
test_optim.py.)"""

from functools import partial

import pytest
import torch
from _gym import cpu_trainer

from align.errors import AlignConfigError
from align.gym import (
    A2CGymModule,
    DQNGymModule,
    Exploration,
    GymClipRange,
    GymUpdates,
    GymValueTraining,
    PPOGymModule,
    QLearningGymModule,
    REINFORCEGymModule,
    ReplayUpdates,
)
from align.gym.make import EnvSpec

CARTPOLE = EnvSpec(id="CartPole-v1", num_envs=2)
ADAM = partial(torch.optim.Adam, lr=1e-3)

BUILDERS = {
    "ppo": lambda: PPOGymModule(
        env=CARTPOLE,
        total_steps=128,
        steps_per_iteration=16,
        updates=GymUpdates(epochs=2, minibatch_size=16),
        optimizer=ADAM,
        lr_schedule="linear",
        clip=GymClipRange(schedule="linear"),
        normalize_observations=True,
        normalize_rewards=True,
    ),
    "a2c": lambda: A2CGymModule(env=CARTPOLE, total_steps=100, steps_per_iteration=5, optimizer=ADAM),
    "reinforce": lambda: REINFORCEGymModule(env=CARTPOLE, total_steps=100, optimizer=ADAM),
    "dqn": lambda: DQNGymModule(
        env=CARTPOLE,
        total_steps=200,
        learning_starts=32,
        steps_per_iteration=8,
        updates=ReplayUpdates(gradient_steps=4, minibatch_size=16),
        target_update_interval=20,
        double_dqn=True,
        optimizer=ADAM,
    ),
    "qlearning": lambda: QLearningGymModule(
        env=EnvSpec(id="FrozenLake-v1", kwargs={"is_slippery": False}),
        total_steps=300,
        steps_per_iteration=50,
        init_value=1.0,
    ),
}
LOSSES = {
    "ppo": {
        "train/policy_loss",
        "train/value_loss",
        "train/entropy",
        "train/clipfrac",
        "train/approx_kl",
        "train/explained_variance",
    },
    "a2c": {"train/policy_loss", "train/value_loss", "train/entropy", "train/explained_variance"},
    "reinforce": {"train/policy_loss", "train/value_loss", "train/entropy"},
    "dqn": {"train/loss", "train/q_mean", "rollout/epsilon", "rollout/buffer_size"},
    "qlearning": {"train/td_error", "rollout/epsilon"},
}


@pytest.mark.parametrize("algorithm", sorted(BUILDERS))
def test_each_module_trains_to_its_step_budget_and_logs(algorithm):
    torch.manual_seed(0)
    module = BUILDERS[algorithm]()
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    trainer = cpu_trainer(max_epochs=1, log_every_n_steps=1)
    trainer.fit(module)
    assert module.total_steps <= module.env_steps < module.total_steps + 64  # stops at the budget
    metrics = module.last_metrics
    assert LOSSES[algorithm] <= set(metrics), sorted(metrics)
    assert {"rollout/env_steps", "rollout/episodes", "rollout/steps_per_s", "train/lr", "time/rollout_s"} <= set(
        metrics
    )
    assert metrics["rollout/env_steps"] == module.env_steps
    assert all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values())
    changed = [k for k, v in module.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "no parameter or buffer moved"
    if algorithm == "ppo":  # linear schedules reach about 0 at the end, and observation statistics were gathered
        assert metrics["train/lr"] < 1e-3 and metrics["train/clip_range"] < 0.2
        assert float(module.network.encoder.count) > 100
        assert float(module.reward_scaler.count) > 100 and "reward_scaler.var" in module.state_dict()


def test_episode_metrics_are_means_of_the_latest_finished_episodes():
    from align.gym.base import RECENT_EPISODES

    torch.manual_seed(0)
    # A policy that barely learns keeps its episodes short (about 22 steps): well over 100 finish in 3,000 steps.
    module = A2CGymModule(
        env=CARTPOLE,
        total_steps=3000,
        steps_per_iteration=5,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-6),
    )
    finished = []
    original = module.runner.pop_episodes

    def recording():
        out = original()
        finished.extend(out)
        return out

    module.runner.pop_episodes = recording
    cpu_trainer(max_epochs=1, log_every_n_steps=3).fit(module)
    assert len(finished) > RECENT_EPISODES and module.runner.episodes == len(finished)
    recent = finished[-RECENT_EPISODES:]
    assert module.last_metrics["rollout/episode_reward"] == pytest.approx(sum(e.reward for e in recent) / len(recent))
    assert module.last_metrics["rollout/episode_length"] == pytest.approx(sum(e.length for e in recent) / len(recent))
    assert module.last_metrics["rollout/episodes"] == len(finished)


def test_metrics_rows_are_written_every_n_steps_and_at_the_end(tmp_path):
    """Steps between the loggers' rows compute and keep no metrics (their values are forgotten after each row);
    every row still holds every metric."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    module = A2CGymModule(env=CARTPOLE, total_steps=300, steps_per_iteration=5, optimizer=ADAM)  # 30 iterations
    cpu_trainer(max_epochs=1, log_every_n_steps=4, logger=CSVLogger(tmp_path)).fit(module)
    rows = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r["train/loss"]]
    assert [int(r["step"]) for r in rows] == [3, 7, 11, 15, 19, 23, 27, 29]
    assert [float(r["rollout/env_steps"]) for r in rows] == [40, 80, 120, 160, 200, 240, 280, 300]
    for row in rows:
        assert all(row[k] for k in ("train/policy_loss", "train/value_loss", "train/lr", "train/entropy"))


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


def test_evaluation_replays_the_same_held_out_episodes():
    torch.manual_seed(0)
    module = BUILDERS["ppo"]()
    first = module.evaluate(episodes=4)
    second = module.evaluate(episodes=4)
    assert [(e.reward, e.length) for e in first] == [(e.reward, e.length) for e in second]
    assert len({e.length for e in module.evaluate(episodes=6)}) > 1  # different seeds per episode


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: DQNGymModule(env=CARTPOLE, learning_starts=-1), r"^model\.learning_starts: expected >= 0, got -1$"),
        (lambda: DQNGymModule(env=CARTPOLE, tau=0.0), r"^model\.tau: expected a value in \(0, 1\], got 0\.0$"),
        (lambda: DQNGymModule(env=CARTPOLE, gamma=1.5), r"^model\.gamma: expected a value in \[0, 1\], got 1\.5$"),
        (lambda: DQNGymModule(env=CARTPOLE, buffer_size=0), r"^model\.buffer_size: expected >= 1, got 0$"),
        (lambda: QLearningGymModule(learning_rate=0.0), r"^model\.learning_rate: expected > 0, got 0\.0$"),
        (lambda: QLearningGymModule(steps_per_iteration=0), r"^model\.steps_per_iteration: expected >= 1, got 0$"),
    ],
)
def test_bad_module_settings_fail_on_one_line_naming_the_setting(build, message):
    with pytest.raises(AlignConfigError, match=message):
        build()


def test_unsupported_spaces_fail_on_one_line_naming_the_environment():
    with pytest.raises(AlignConfigError) as err:
        DQNGymModule(env=EnvSpec(id="Pendulum-v1"))
    message = str(err.value)
    assert "\n" not in message
    assert "environment 'Pendulum-v1': DQN needs a Discrete action space, got Box(shape=(1,)" in message
    with pytest.raises(
        AlignConfigError,
        match="environment 'CartPole-v1': tabular Q-learning needs a Discrete "
        r"observation space, got Box\(shape=\(4,\)\)",
    ):
        QLearningGymModule(env=EnvSpec(id="CartPole-v1"))
    with pytest.raises(
        AlignConfigError, match="environment 'CartPol-v1': not a registered Gymnasium id .* CartPole-v1"
    ):
        PPOGymModule(env=EnvSpec(id="CartPol-v1"))


def test_dqn_target_network_follows_the_interval_and_tau():
    torch.manual_seed(0)
    module = DQNGymModule(
        env=CARTPOLE,
        total_steps=64,
        learning_starts=10_000,
        steps_per_iteration=4,
        target_update_interval=16,
        tau=0.5,
        optimizer=ADAM,
    )
    with torch.no_grad():
        for p in module.q.parameters():
            p.add_(1.0)
    target = [p.clone() for p in module.q_target.parameters()]
    module.collect(module.sample_actions, 4, on_step=module._store)  # 8 env steps: no update yet
    assert all(torch.equal(a, b) for a, b in zip(target, module.q_target.parameters()))
    module.collect(module.sample_actions, 4, on_step=module._store)  # 16 env steps: one Polyak step, tau 0.5
    for before, online, now in zip(target, module.q.parameters(), module.q_target.parameters()):
        torch.testing.assert_close(now, 0.5 * before + 0.5 * online)


@pytest.mark.parametrize("double_dqn", [False, True])
def test_dqn_gradient_steps_drawn_together_equal_the_step_by_step_updates(double_dqn, monkeypatch):
    """DQN draws several gradient steps' batches at once and computes their target values in one pass (the
    target network is fixed during them); the updates are those of drawing and computing step by step."""
    import copy

    import torch.nn.functional as F

    import align.gym.dqn as dqn
    from align.gym.returns import td_targets

    torch.manual_seed(0)
    module = DQNGymModule(
        env=CARTPOLE,
        total_steps=10_000,
        learning_starts=0,
        updates=ReplayUpdates(gradient_steps=6, minibatch_size=8),
        target_update_interval=10_000,
        double_dqn=double_dqn,
    )
    module.collect(module.sample_actions, 16, on_step=module._store)  # 32 transitions
    with torch.no_grad():
        for p in module.q_target.parameters():
            p.add_(0.05 * torch.randn_like(p))  # a target unlike the online network
    row_bytes = sum(store[0].numel() * store.element_size() for store in module.buffer.storage.values())
    monkeypatch.setattr(dqn, "DRAW_BYTES", row_bytes * 8 * 4)  # draws of 4 steps, then 2
    monkeypatch.setattr(dqn, "TARGET_ROWS", 5)  # the target network over a draw's 32 rows in chunks of 5
    assert module._steps_per_draw() == 4
    reference = copy.deepcopy(module.q)
    optimizer = torch.optim.SGD(module.q.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)

    def step(loss):
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    module.optimizer_step = step
    module.collect = lambda *args, **kwargs: None  # this iteration only learns
    module.explorer = lambda num_steps: None  # (and draws no exploration)
    rng = torch.get_rng_state()
    module.iteration()
    torch.set_rng_state(rng)
    for _ in range(6):
        batch = module.buffer.sample(8)
        with torch.no_grad():
            next_online = reference(batch["next_observations"]) if double_dqn else None
            targets = td_targets(
                batch["rewards"],
                module.q_target(batch["next_observations"]),
                batch["terminated"],
                module.gamma,
                next_online,
            )
        q = reference(batch["observations"]).gather(1, batch["actions"].long().view(-1, 1)).squeeze(1)
        reference_optimizer.zero_grad()
        F.smooth_l1_loss(q, targets).backward()
        reference_optimizer.step()
    for ours, theirs in zip(module.q.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    assert not torch.equal(next(module.q.parameters()), next(copy.deepcopy(module.q_target).parameters()))


def test_exploration_schedule_is_linear_in_environment_steps():
    module = DQNGymModule(env=CARTPOLE, total_steps=1000, exploration=Exploration(1.0, 0.1, 0.5))
    assert module.epsilon() == 1.0
    module.runner.steps = 250
    assert module.epsilon() == pytest.approx(0.55)
    module.runner.steps = 900
    assert module.epsilon() == pytest.approx(0.1)


def test_explorer_draws_what_act_would_draw_step_by_step():
    """The training policy's draws are taken once per iteration: environment ``i`` at step ``k`` explores when
    ``u[k, i] < epsilon(env_steps + k * N)`` and then takes ``random[k, i]``, else the greedy action."""
    module = DQNGymModule(env=CARTPOLE, total_steps=40, exploration=Exploration(1.0, 0.0, 0.5), hidden=(8,))
    obs = module.runner.start()
    module.runner.steps = 6
    torch.manual_seed(3)
    policy = module.explorer(12)
    torch.manual_seed(3)
    u, random = torch.rand(12, 2), torch.randint(0, 2, (12, 2))
    greedy = module.q(obs).argmax(dim=1)
    for k in range(12):
        epsilon = max(1.0 - (6 + 2 * k) / 20, 0.0)  # 1 -> 0 over the first 20 of 40 steps
        want = torch.where(u[k] < epsilon, random[k], greedy)
        assert torch.equal(policy(obs)[0], want), k
    with pytest.raises(StopIteration):
        policy(obs)  # drawn for 12 steps only


def test_explorer_skips_the_network_when_every_environment_explores(monkeypatch):
    module = DQNGymModule(env=CARTPOLE, total_steps=100, exploration=Exploration(1.0, 1.0, 0.5))
    monkeypatch.setattr(module.q, "greedy", lambda obs: pytest.fail("the Q-network ran at epsilon 1"))
    module.collect(module.explorer(5), 5, on_step=module._store)
    assert len(module.buffer) == 10


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_q_network_greedy_is_the_argmax_of_its_forward_after_updates_and_loads(activation):
    import gymnasium as gym

    from align.gym.networks import QNetwork

    torch.manual_seed(0)
    space = gym.spaces.Box(-1, 1, (3,))
    q = QNetwork(space, 5, (16, 16), activation)
    obs = torch.randn(64, 3)
    assert torch.equal(q.greedy(obs), q(obs).argmax(dim=1))
    optimizer = torch.optim.SGD(q.parameters(), lr=1.0)
    q(obs).square().sum().backward()
    optimizer.step()  # in place: the cached layers see it
    assert torch.equal(q.greedy(obs), q(obs).argmax(dim=1))
    other = QNetwork(space, 5, (16, 16), activation)
    q.load_state_dict(other.state_dict())
    assert torch.equal(q.greedy(obs), other(obs).argmax(dim=1))
    q.net[0].weight = torch.nn.Parameter(torch.randn(16, 3))  # replaced, not updated: the cache is rebuilt
    assert torch.equal(q.greedy(obs), q(obs).argmax(dim=1))
    assert not torch.is_grad_enabled() or q.greedy(obs).grad_fn is None


def test_optimizer_steps_are_counted_and_step_hooks_still_run():
    """Without a listener, the classic modules step torch's optimizer without Lightning's hook dispatch; the
    trainer's step count is the same, and a callback with ``on_before_optimizer_step`` gets every step."""
    import lightning.pytorch as L

    class Count(L.Callback):
        def __init__(self):
            self.calls = 0

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.calls += 1

    steps = {}
    for hooked in (False, True):
        torch.manual_seed(0)
        module = DQNGymModule(
            env=CARTPOLE,
            total_steps=96,
            learning_starts=20,
            steps_per_iteration=8,
            updates=ReplayUpdates(gradient_steps=3, minibatch_size=8),
            hidden=(16,),
            optimizer=ADAM,
        )
        count = Count()
        trainer = cpu_trainer(max_epochs=1, callbacks=[count] if hooked else [])
        trainer.fit(module)
        assert module._unhooked_steps is (not hooked)
        steps[hooked] = (trainer.global_step, [p.detach().clone() for p in module.q.parameters()])
        if hooked:
            assert count.calls == trainer.global_step
    assert steps[False][0] == steps[True][0] == 3 * 5  # 6 iterations of 16 env steps; from 32 on they learn
    for a, b in zip(steps[False][1], steps[True][1]):
        torch.testing.assert_close(a, b)


def test_several_processes_are_refused_on_one_line():
    from types import SimpleNamespace

    module = BUILDERS["a2c"]()
    module._trainer = SimpleNamespace(world_size=2)
    with pytest.raises(AlignConfigError, match="trainer.devices: classic RL runs in one process .* got 2 processes"):
        module.setup("fit")


class NaNRewardEnv:
    """CartPole whose fifth step pays NaN."""

    def __new__(cls):
        import gymnasium as gym

        class Env(gym.Wrapper):
            def __init__(self):
                super().__init__(gym.make("CartPole-v1"))
                self.steps = 0

            def step(self, action):
                obs, reward, terminated, truncated, info = self.env.step(action)
                self.steps += 1
                return obs, float("nan") if self.steps == 5 else reward, terminated, truncated, info

        return Env()


def test_a_non_finite_loss_stops_the_run_before_the_update():
    from align.trainer.guards import NonFiniteError

    torch.manual_seed(0)
    module = A2CGymModule(
        env=EnvSpec(id=f"{__file__}:NaNRewardEnv"), total_steps=100, steps_per_iteration=5, optimizer=ADAM
    )
    assert module.guards_own_steps  # the check is in optimizer_step; no NonFiniteGuard pass over the gradients
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(
        NonFiniteError, match=r"non-finite loss at optimizer step 0 \(iteration 0, 5 environment steps\)"
    ):
        cpu_trainer(max_epochs=1).fit(module)
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k

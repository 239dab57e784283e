"""The classic-RL base module (align.gym.base) on Gymnasium: each module trains inside a Trainer to its step budget
and logs its metrics, episode metrics are means of the latest finished episodes, metrics rows are written every n
steps and at the end, evaluation replays the same held-out episodes, optimizer steps are counted with or without
step hooks, several processes are refused and a non-finite loss stops the run before the update. (Learning to solve
CartPole is in tests/e2e/test_gym_learning.py; each module's own parts in test_onpolicy.py and test_dqn.py.)"""

from functools import partial

import pytest
import torch
from _gym import cpu_trainer

from align.errors import AlignConfigError
from align.gym import (
    A2CGymModule,
    DQNGymModule,
    GymClipRange,
    GymUpdates,
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


def test_evaluation_replays_the_same_held_out_episodes():
    torch.manual_seed(0)
    module = BUILDERS["ppo"]()
    first = module.evaluate(episodes=4)
    second = module.evaluate(episodes=4)
    assert [(e.reward, e.length) for e in first] == [(e.reward, e.length) for e in second]
    assert len({e.length for e in module.evaluate(episodes=6)}) > 1  # different seeds per episode


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

"""DQN and tabular Q-learning (align.gym.dqn): settings checked naming the setting, the target network following the
interval and tau, gradient steps drawn together equal to the step-by-step updates, and the exploration schedule and
explorer drawing what acting step by step would."""

from functools import partial

import pytest
import torch

from align.errors import AlignConfigError
from align.gym import DQNGymModule, Exploration, QLearningGymModule, ReplayUpdates
from align.gym.make import EnvSpec

CARTPOLE = EnvSpec(id="CartPole-v1", num_envs=2)
ADAM = partial(torch.optim.Adam, lr=1e-3)


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

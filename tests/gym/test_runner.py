"""The environment runner (align.gym.runner): per-episode seeds, windows of steps, complete episodes, exact resume
mid-episode, and one-line errors for an environment whose reset or step raises.

The small environments are loaded by the runner through the import path of _envs.py
(``/abs/path/tests/gym/_envs.py:Corridor``), the way a user names their own environment class."""

import io
import logging
import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from align.errors import AlignEnvError
from align.gym.make import EnvSpec
from align.gym.runner import EnvRunner, episode_seed

ENVS = str(Path(__file__).with_name("_envs.py").resolve())


def constant(action: int):
    return lambda obs: (torch.full((obs.shape[0],), action, dtype=torch.long), {})


def random_policy(seed: int, record: list | None = None):
    rng = np.random.default_rng(seed)

    def policy(obs):
        actions = torch.as_tensor(rng.integers(0, 2, size=obs.shape[0]))
        if record is not None:
            record.append(actions)
        return actions, {}

    return policy


def replaying(actions: list):
    it = iter(actions)
    return lambda obs: (next(it), {})


def reset_observation(runner: EnvRunner, env_index: int, episode: int) -> np.ndarray:
    """What a lone environment of the spec shows after its reset with that episode's seed."""
    env = gym.make(runner.spec.id, **runner.spec.kwargs)
    obs, _ = env.reset(seed=runner.episode_seed(env_index, episode))
    env.close()
    return np.asarray(obs)


# ---------------------------------------------------------------- seeds


def test_same_spec_and_seed_same_observations():
    spec = EnvSpec(id="CartPole-v1", num_envs=2, seed=7)
    a, b = EnvRunner(spec), EnvRunner(spec)
    actions = [torch.tensor([k % 2, 1]) for k in range(30)]  # env 1 falls over (an episode ends) within 30 steps
    sa, sb = a.collect(replaying(actions), 30), b.collect(replaying(actions), 30)
    assert sa.done.any()
    for name in ("observations", "rewards", "next_observations", "terminated", "done"):
        assert torch.equal(getattr(sa, name), getattr(sb, name)), name
    other = EnvRunner(EnvSpec(id="CartPole-v1", num_envs=2, seed=8))
    assert not torch.equal(other.start(), sa.observations[0])


def test_env_indices_episodes_and_streams_get_different_seeds():
    spec = EnvSpec(id="CartPole-v1", num_envs=2, seed=0)
    train, evaluation = EnvRunner(spec), EnvRunner(spec, stream=1)
    seeds = {
        (s, i, e): r.episode_seed(i, e) for s, r in enumerate((train, evaluation)) for i in range(4) for e in range(4)
    }
    assert len(set(seeds.values())) == len(seeds) == 32
    assert train.episode_seed(1, 2) == EnvRunner(spec).episode_seed(1, 2)  # a pure function of its inputs
    assert (train.episode_seed(1, 2), evaluation.episode_seed(1, 2)) == (
        episode_seed(0, 0, 1, 2),
        episode_seed(0, 1, 1, 2),
    )
    obs_train, obs_eval = train.start(), evaluation.start()
    assert not torch.equal(obs_train[0], obs_train[1])
    assert not torch.equal(obs_train, obs_eval)
    # Each environment's episode is reset with exactly its own seed.
    for i in range(2):
        np.testing.assert_array_equal(obs_train[i].numpy(), reset_observation(train, i, 0))
        np.testing.assert_array_equal(obs_eval[i].numpy(), reset_observation(evaluation, i, 0))


# ---------------------------------------------------------------- collect and episodes


def test_collect_shapes_and_episode_boundaries():
    runner = EnvRunner(EnvSpec(id="CartPole-v1", num_envs=2, seed=1))

    def policy(obs):
        return torch.ones(obs.shape[0], dtype=torch.long), {"value": obs[:, 0] * 2}

    steps = runner.collect(policy, 30)
    assert steps.shape == (30, 2) and steps.count == 60
    assert steps.observations.shape == steps.next_observations.shape == (30, 2, 4)
    assert steps.actions.shape == (30, 2) and steps.rewards.shape == (30, 2)
    assert steps.rewards.dtype == torch.float32
    assert steps.done.dtype == steps.terminated.dtype == torch.bool
    assert steps.extras["value"].shape == (30, 2)
    torch.testing.assert_close(steps.extras["value"], steps.observations[..., 0] * 2)
    assert runner.steps == 60
    ends = steps.done.nonzero().tolist()
    assert ends, "always pushing right ends a CartPole episode within 30 steps"
    episode = [0, 0]
    for t in range(29):
        for i in range(2):
            if steps.done[t, i]:
                episode[i] += 1
                final = steps.next_observations[t, i]
                # the final observation is the fallen pole, not the reset one
                assert final[0].abs() > 2.4 or final[2].abs() > 12 * 2 * np.pi / 360
                assert not torch.equal(final, steps.observations[t + 1, i])
                np.testing.assert_array_equal(
                    steps.observations[t + 1, i].numpy(), reset_observation(runner, i, episode[i])
                )
            else:
                assert torch.equal(steps.next_observations[t, i], steps.observations[t + 1, i])
    assert torch.equal(steps.terminated, steps.done)  # CartPole's time limit (500) is not reached
    runner.collect(policy, 5)
    assert runner.steps == 70


def expected_episodes(steps) -> list[tuple[float, int, bool]]:
    """(return, length, truncated) of the episodes that end in ``steps``, in the order they end (time, then env)."""
    t_len, n = steps.shape
    running = [[0.0, 0] for _ in range(n)]
    out = []
    for t in range(t_len):
        for i in range(n):
            running[i][0] += float(steps.rewards[t, i])
            running[i][1] += 1
            if steps.done[t, i]:
                out.append((running[i][0], running[i][1], not bool(steps.terminated[t, i])))
                running[i] = [0.0, 0]
    return out


@pytest.mark.parametrize(
    "env_id, max_steps",
    [
        ("CartPole-v1", None),  # Box observations
        ("FrozenLake-v1", None),  # Discrete observations
        ("Pendulum-v1", 7),  # continuous actions, time-limit truncations
        (f"{ENVS}:Corridor", 4),  # rewards drawn from np_random
    ],
)
def test_sync_copies_stepped_directly_equal_gymnasiums_sync_vector_step(env_id, max_steps):
    """The runner steps and resets a sync vector environment's copies itself; Gymnasium's SyncVectorEnv.step and
    reset (with a reset mask) give the same windows and episodes."""
    spec = EnvSpec(id=env_id, num_envs=3, seed=2, max_episode_steps=max_steps)
    direct, through_gymnasium = EnvRunner(spec), EnvRunner(spec)
    assert direct._copies is not None
    through_gymnasium._copies = None
    rng = np.random.default_rng(0)
    if env_id.startswith("Pendulum"):
        actions = [torch.as_tensor(rng.uniform(-2, 2, (3, 1)), dtype=torch.float32) for _ in range(40)]
    else:
        actions = [torch.as_tensor(rng.integers(0, 4 if "Frozen" in env_id else 2, 3)) for _ in range(40)]
    a, b = direct.collect(replaying(actions), 40), through_gymnasium.collect(replaying(actions), 40)
    assert a.done.any()
    for name in ("observations", "actions", "rewards", "next_observations", "terminated", "done"):
        assert getattr(a, name).dtype == getattr(b, name).dtype, name
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert direct.pop_episodes() == through_gymnasium.pop_episodes()
    assert torch.equal(direct.start(), through_gymnasium.start())


def test_pop_episodes_returns_lengths_and_truncation():
    # max_episode_steps on a custom class: episodes that dawdle are truncated after 5 steps.
    runner = EnvRunner(EnvSpec(id=f"{ENVS}:Corridor", num_envs=3, seed=2, max_episode_steps=5))
    steps = runner.collect(random_policy(0), 40)
    expected = expected_episodes(steps)
    episodes = runner.pop_episodes()
    assert runner.pop_episodes() == []
    assert len(episodes) == len(expected) == runner.episodes > 3
    assert {e.truncated for e in episodes} == {True, False}
    for k, (episode, (ret, length, truncated)) in enumerate(zip(episodes, expected), start=1):
        assert episode.reward == pytest.approx(ret, rel=1e-6)
        assert (episode.length, episode.truncated, episode.index) == (length, truncated, k)
        assert 1 <= episode.length <= 5
    truncated_at = steps.done & ~steps.terminated
    assert truncated_at.any()


def test_env_actions_go_to_the_environment():
    runner = EnvRunner(EnvSpec(id=f"{ENVS}:Corridor", num_envs=2, kwargs={"length": 50}))
    start = runner.start().clone()

    def policy(obs):
        zeros = torch.zeros(obs.shape[0], dtype=torch.long)
        return zeros, {"env_actions": zeros + 1, "logprobs": torch.zeros(obs.shape[0])}

    steps = runner.collect(policy, 3)
    assert torch.equal(steps.actions, torch.zeros(3, 2, dtype=torch.long))  # as the policy sampled them
    assert torch.equal(steps.next_observations[-1], start + 3)  # the environment moved right three times
    assert set(steps.extras) == {"logprobs"}
    assert runner.state_dict()["actions"][0].tolist() == [1, 1, 1]  # what a resume replays


def test_collect_episodes_one_episode_per_env():
    runner = EnvRunner(EnvSpec(id="CartPole-v1", num_envs=3, seed=4))
    runner.collect(random_policy(1), 5)  # episodes in progress, dropped by collect_episodes
    runner.pop_episodes()
    steps = runner.collect_episodes(random_policy(2))
    t_len = steps.shape[0]
    assert steps.valid.shape == (t_len, 3)
    firsts = []
    for i in range(3):
        done = steps.done[:, i].nonzero().flatten().tolist()
        first = done[0]
        firsts.append(first)
        assert steps.valid[: first + 1, i].all() and not steps.valid[first + 1 :, i].any()
        assert int((steps.done[:, i] & steps.valid[:, i]).sum()) == 1  # exactly one episode counted per env
        # from a fresh reset with the next episode's seed (the interrupted episode 0 is dropped)
        np.testing.assert_array_equal(steps.observations[0, i].numpy(), reset_observation(runner, i, 1))
    assert t_len == max(firsts) + 1  # stops when every environment has finished one episode
    assert steps.count == sum(f + 1 for f in firsts)
    lengths = sorted(e.length for e in runner.pop_episodes())
    for f in firsts:
        assert f + 1 in lengths


def test_collect_episodes_that_never_end():
    runner = EnvRunner(EnvSpec(id=f"{ENVS}:Corridor", num_envs=1))
    with pytest.raises(
        AlignEnvError,
        match=re.escape(
            f"environment '{ENVS}:Corridor': an episode ran 6 steps without ending; set model.env.max_episode_steps"
        ),
    ):
        runner.collect_episodes(constant(0), max_steps=6)


# ---------------------------------------------------------------- exact resume


def _save_load(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _staggered(runner: EnvRunner, seed: int, limit: int = 300) -> None:
    """Step until one environment has just been reset (no action in its episode) and every environment is at a
    different point of its episode."""
    policy = random_policy(seed)
    for _ in range(limit):
        runner.step(policy)
        lengths = runner.state_dict()["length"].tolist()
        if 0 in lengths and len(set(lengths)) == runner.num_envs and runner.episodes >= runner.num_envs:
            return
    pytest.fail(f"no staggered state within {limit} steps")


@pytest.mark.parametrize(
    "env_id, num_envs, vectorization, max_steps",
    [
        ("CartPole-v1", 3, "sync", None),
        ("CartPole-v1", 2, "async", None),
        ("FrozenLake-v1", 3, "sync", None),
        (f"{ENVS}:Corridor", 3, "sync", 4),  # time-limit truncations, rewards drawn from np_random
    ],
)
def test_exact_resume(env_id, num_envs, vectorization, max_steps):
    spec = EnvSpec(id=env_id, num_envs=num_envs, vectorization=vectorization, seed=5, max_episode_steps=max_steps)
    killed, resumed = EnvRunner(spec), None
    try:
        _staggered(killed, seed=0)
        saved = killed.state_dict()
        lengths = saved["length"].tolist()
        assert 0 in lengths and len(set(lengths)) == num_envs
        killed.pop_episodes()
        actions: list = []
        continued = killed.collect(random_policy(1, actions), 40)
        assert continued.done.any()

        resumed = EnvRunner(spec)
        resumed.load_state_dict(_save_load(saved))
        restored = resumed.state_dict()
        for key in ("episode", "return", "length", "observations"):
            assert torch.equal(restored[key], saved[key]), key
        assert (restored["steps"], restored["episodes"]) == (saved["steps"], saved["episodes"])
        for mine, theirs in zip(restored["actions"], saved["actions"]):
            assert mine.tolist() == theirs.tolist()

        replayed = resumed.collect(replaying(actions), 40)
        for name in ("observations", "actions", "rewards", "next_observations", "terminated", "done"):
            assert torch.equal(getattr(continued, name), getattr(replayed, name)), name
        assert resumed.pop_episodes() == killed.pop_episodes()  # returns, lengths and indices continue
        assert resumed.steps == killed.steps
    finally:
        killed.close()
        if resumed is not None:
            resumed.close()


def test_resume_before_any_step_and_before_start():
    spec = EnvSpec(id="CartPole-v1", num_envs=2, seed=9)
    fresh = EnvRunner(spec)
    unstarted = fresh.state_dict()
    assert unstarted["observations"] is None
    fresh.start()
    started = fresh.state_dict()
    reference = fresh.collect(constant(1), 12)
    for state in (unstarted, started):
        runner = EnvRunner(spec)
        runner.load_state_dict(_save_load(state))
        steps = runner.collect(constant(1), 12)
        assert torch.equal(steps.observations, reference.observations)
        assert torch.equal(steps.done, reference.done)


def test_resume_of_an_unreproducible_env_warns(caplog):
    runner = EnvRunner(EnvSpec(id=f"{ENVS}:Unseeded"))
    runner.collect(constant(0), 2)
    state = runner.state_dict()
    resumed = EnvRunner(EnvSpec(id=f"{ENVS}:Unseeded"))
    with caplog.at_level(logging.WARNING, logger="align.gym.runner"):
        resumed.load_state_dict(state)
    assert f"environment '{ENVS}:Unseeded' did not reproduce its episodes" in caplog.text
    assert resumed.state_dict()["length"].tolist() == [2]  # it carries on from the replayed state
    assert resumed.collect(constant(0), 1).shape == (1, 1)


def test_state_dict_round_trips_through_a_file(tmp_path):
    runner = EnvRunner(EnvSpec(id="FrozenLake-v1", num_envs=2, seed=3))
    runner.collect(random_policy(3), 7)
    state = runner.state_dict()
    torch.save(state, tmp_path / "runner.pt")
    loaded = torch.load(tmp_path / "runner.pt", weights_only=True)
    assert loaded.keys() == state.keys()
    assert (loaded["steps"], loaded["episodes"]) == (14, state["episodes"])
    for key in ("episode", "return", "length", "observations"):
        assert torch.equal(loaded[key], state[key])
    assert [a.tolist() for a in loaded["actions"]] == [a.tolist() for a in state["actions"]]


def test_load_state_dict_with_other_num_envs():
    small = EnvRunner(EnvSpec(id="CartPole-v1", num_envs=2))
    small.collect(constant(0), 2)
    with pytest.raises(
        AlignEnvError,
        match=r"environment 'CartPole-v1': the checkpoint holds 2 environments, this "
        r"run has 3 \(model.env.num_envs\)",
    ):
        EnvRunner(EnvSpec(id="CartPole-v1", num_envs=3)).load_state_dict(small.state_dict())


# ---------------------------------------------------------------- errors, one line each


def test_step_that_raises():
    runner = EnvRunner(EnvSpec(id=f"{ENVS}:Explodes", num_envs=2))
    with pytest.raises(
        AlignEnvError,
        match=re.escape(
            f"environment '{ENVS}:Explodes': step raised RuntimeError: boom (episodes 0, 0 of its 2 copies)"
        ),
    ):
        runner.collect(constant(1), 1)


def test_reset_that_raises():
    with pytest.raises(AlignEnvError, match=re.escape(f"environment '{ENVS}:ResetExplodes': reset raised KeyError")):
        EnvRunner(EnvSpec(id=f"{ENVS}:ResetExplodes")).start()


# ---------------------------------------------------------------- custom environments by import path

"""Environments made from a spec (align.gym.make): the spec's checks, Gymnasium ids and classes named by file or
dotted path with their keyword arguments and time limit, and one-line errors naming the environment for an id that
does not resolve, a constructor or factory that fails, an observation outside its space and an action space an
algorithm cannot use.

The small environments are loaded through the import path of _envs.py, the way a user names their own class."""

import re
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from align.errors import AlignConfigError, AlignEnvError
from align.gym import DQNGymModule, PPOGymModule, QLearningGymModule
from align.gym.make import EnvSpec, require_discrete_actions
from align.gym.runner import EnvRunner

ENVS = str(Path(__file__).with_name("_envs.py").resolve())


def constant(action: int):
    return lambda obs: (torch.full((obs.shape[0],), action, dtype=torch.long), {})


WALK_SOURCE = '''
import gymnasium as gym


class Walk(gym.Env):
    """Counts steps; never terminates by itself."""

    observation_space = gym.spaces.Discrete(100)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, reward=1.0):
        self.reward, self.t = reward, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return 0, {}

    def step(self, action):
        self.t += 1
        return self.t, self.reward, False, False, {}
'''


def test_unknown_id_suggests_close_ones():
    with pytest.raises(
        AlignConfigError,
        match=r"environment 'CartPol-v1': not a registered Gymnasium id and not an "
        r"import path.*close registered ids: CartPole-v1",
    ) as info:
        EnvRunner(EnvSpec(id="CartPol-v1"))
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path):
    path = tmp_path / "missing_envs.py"
    with pytest.raises(AlignConfigError, match=re.escape(f"environment '{path}:Grid': file '{path}' does not exist")):
        EnvRunner(EnvSpec(id=f"{path}:Grid"))


def test_missing_class_in_file():
    with pytest.raises(
        AlignConfigError, match=re.escape(f"environment '{ENVS}:Nope': '{ENVS}' has no attribute 'Nope'")
    ):
        EnvRunner(EnvSpec(id=f"{ENVS}:Nope"))


def test_missing_module(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(
        AlignConfigError,
        match=r"environment 'no_such_envs_module.Grid': cannot import module "
        r"'no_such_envs_module'",
    ):
        EnvRunner(EnvSpec(id="no_such_envs_module.Grid"))


def test_constructor_rejects_kwargs():
    with pytest.raises(
        AlignConfigError,
        match=re.escape(f"environment '{ENVS}:Fixed': its constructor refused model.env.kwargs {{'size': 3}}"),
    ):
        EnvRunner(EnvSpec(id=f"{ENVS}:Fixed", kwargs={"size": 3}))
    with pytest.raises(
        AlignConfigError,
        match=r"environment 'CartPole-v1': its constructor refused "
        r"model.env.kwargs \{'size': 3\}",
    ):
        EnvRunner(EnvSpec(id="CartPole-v1", kwargs={"size": 3}))


def test_factory_that_returns_no_env():
    with pytest.raises(
        AlignConfigError,
        match=re.escape(f"environment '{ENVS}:not_an_env': calling it gave a int, not a gymnasium.Env"),
    ):
        EnvRunner(EnvSpec(id=f"{ENVS}:not_an_env"))


def test_observation_of_wrong_shape_names_the_env():
    expected = (
        f"environment '{ENVS}:WrongShape': reset returned an observation of shape (3,), outside its observation space"
    )
    with pytest.raises(AlignEnvError, match=re.escape(expected)) as info:
        EnvRunner(EnvSpec(id=f"{ENVS}:WrongShape")).start()
    assert "\n" not in str(info.value)


def test_observation_of_wrong_shape_names_the_space():
    with pytest.raises(AlignEnvError, match=r"Box\(shape=\(4,\), float32\)"):
        EnvRunner(EnvSpec(id=f"{ENVS}:WrongShape")).start()


def test_observation_outside_discrete_space():
    runner = EnvRunner(EnvSpec(id=f"{ENVS}:OutOfRange"))
    with pytest.raises(AlignEnvError, match=re.escape(f"environment '{ENVS}:OutOfRange'") + r".*Discrete\(4\)"):
        runner.collect(constant(1), 1)


def test_require_discrete_actions():
    spec = EnvSpec(id="Pendulum-v1")
    box = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)
    with pytest.raises(
        AlignConfigError,
        match=r"environment 'Pendulum-v1': DQN needs a Discrete action space, got "
        r"Box\(shape=\(1,\), float32\)",
    ):
        require_discrete_actions(spec, box, "DQN")
    assert require_discrete_actions(spec, gym.spaces.Discrete(3), "DQN") == 3


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"num_envs": 0}, "num_envs"),
        ({"vectorization": "threads"}, "vectorization"),
        ({"max_episode_steps": 0}, "max_episode_steps"),
        ({"id": "  "}, "id"),
    ],
)
def test_spec_validation(fields, name):
    with pytest.raises(AlignConfigError, match=rf"model\.env\.{name}: expected"):
        EnvSpec(**fields)


def test_custom_env_from_file_with_time_limit(monkeypatch, tmp_path):
    (tmp_path / "walk_envs.py").write_text(WALK_SOURCE)
    monkeypatch.chdir(tmp_path)  # the path is relative to the working directory
    runner = EnvRunner(EnvSpec(id="walk_envs.py:Walk", kwargs={"reward": 0.5}, max_episode_steps=3, num_envs=2))
    steps = runner.collect(constant(0), 7)
    assert steps.done[:, 0].tolist() == [False, False, True, False, False, True, False]
    assert not steps.terminated.any()  # truncated by the time limit, not terminated
    assert steps.next_observations[2, 0].item() == 3 and steps.observations[3, 0].item() == 0
    episodes = runner.pop_episodes()
    assert [(e.reward, e.length, e.truncated) for e in episodes] == [(1.5, 3, True)] * 4


def test_custom_env_by_dotted_path(monkeypatch, tmp_path):
    module = "align_test_walk_envs_dotted"
    (tmp_path / f"{module}.py").write_text(WALK_SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader appends the working directory
    monkeypatch.delitem(sys.modules, module, raising=False)
    try:
        runner = EnvRunner(EnvSpec(id=f"{module}.Walk", max_episode_steps=2))
        steps = runner.collect(constant(1), 4)
        assert steps.done[:, 0].tolist() == [False, True, False, True]
        assert isinstance(runner.observation_space, gym.spaces.Discrete)
        # without a time limit the class has none: it never ends
        steps = EnvRunner(EnvSpec(id=f"{module}.Walk")).collect(constant(1), 4)
        assert not steps.done.any()
    finally:
        sys.modules.pop(module, None)


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

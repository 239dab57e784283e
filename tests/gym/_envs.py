"""Small environments for the runner's and the environment factory's tests (test_runner.py, test_make.py), loaded
through the import path of this file (``/abs/path/tests/gym/_envs.py:Corridor``), the way a user names their own
environment class."""

import gymnasium as gym
import numpy as np


class Corridor(gym.Env):
    """Positions ``0 .. length``; action 1 steps right, 0 stays. The start (0 or 1) and a small part of each reward
    come from ``np_random``, so observations and rewards depend on the reset seed. Terminates at ``length``."""

    action_space = gym.spaces.Discrete(2)

    def __init__(self, length: int = 4):
        self.length = length
        self.observation_space = gym.spaces.Discrete(length + 1)
        self.position = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.position = int(self.np_random.integers(0, 2))
        return self.position, {}

    def step(self, action):
        self.position = min(self.position + int(action), self.length)
        reward = self.position + int(action) + float(self.np_random.random()) / 10
        return self.position, reward, self.position == self.length, False, {}


class Fixed(Corridor):
    """A constructor that takes no keyword arguments."""

    def __init__(self):
        super().__init__(length=3)


class WrongShape(Corridor):
    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)

    def __init__(self):
        super().__init__()
        self.observation_space = WrongShape.observation_space

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, np.float32), {}

    def step(self, action):
        return np.zeros(3, np.float32), 0.0, False, False, {}


class OutOfRange(Corridor):
    """Declares ``Discrete(4)`` and steps to observation 9."""

    def __init__(self):
        super().__init__(length=3)

    def step(self, action):
        return 9, 0.0, False, False, {}


class Explodes(Corridor):
    def step(self, action):
        raise RuntimeError("boom")


class ResetExplodes(Corridor):
    def reset(self, *, seed=None, options=None):
        raise KeyError("no start state")


class Unseeded(gym.Env):
    """Draws its start from NumPy's global generator instead of ``np_random``: a replay cannot reproduce it."""

    observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.state = np.array([np.random.random()], np.float32)
        return self.state, {}

    def step(self, action):
        return self.state, 1.0, False, False, {}


def not_an_env():
    return 3

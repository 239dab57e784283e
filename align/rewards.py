"""``align.rewards``: the public path of the reward functions and classes that configs name
(``align.rewards.math_answer``), an alias of :mod:`align.rollout.rewards`."""

from align.rollout.rewards import *  # noqa: F401,F403
from align.rollout.rewards import __all__  # noqa: F401

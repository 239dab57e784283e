"""Reward functions: plain callables named by import path, combined with weights, checked on every call.

A reward function has the signature (docs/rewards.md)::

    def my_reward(prompts: list[str], completions: list[str], **columns) -> list[float]: ...

and is called with keyword arguments only: ``prompts[i]`` is the i-th prompt as written in the data (for a
list of messages, the content of its last message), ``completions[i]`` the decoded response, every extra
dataset column arrives under its own name with one value per completion (``answer=[...]``), and so do the
rollout's inputs ``prompt_messages``, ``completion_ids`` and ``completion_truncated``. TRL's form
``def reward(completions, **kwargs)`` therefore works as is. A function without ``**kwargs`` receives only
the arguments its signature names; one that requires an argument nobody provides fails before the first
rollout. A YAML config names a function by import path::

    rewards:
      - fn: align.rewards.sort_exact_match        # a module attribute
      - fn: my_rewards.brevity                    # ./my_rewards.py: the working directory is importable
        weight: 0.1
      - fn: checks/style.py:politeness            # a function in a file (relative to the working directory)

The total reward of a completion is ``sum(weight * reward)`` over the rewards that apply to it (a reward returns
``None`` for a row it does not apply to); each reward is also logged on its own as ``rollout/reward/<name>``. The
rewards of a batch are evaluated together (:mod:`~align.rollout.rewards.concurrent`: async functions awaited
together, plain ones on threads; ``concurrency`` and ``timeout`` per reward). Any value that is NaN or infinite, a
result of the wrong length, or an exception raised inside a reward function stops the run with a one-line
:class:`RewardError` that names the reward, and for an exception also the file and line in the user's code and the
first failing sample. An import path that does not resolve fails when the module is built, before training.

Built-in rewards (:mod:`align.rollout.rewards.builtin`): :func:`sort_exact_match`, :func:`sort_format` and the
graded :func:`sort_position_match` for the bundled sort task (:mod:`align.data.sort_task`), :func:`math_answer`
for GSM8K-style math answers, and :func:`math_verify` (:mod:`~align.rollout.rewards.mathverify`), math answers
checked by the math-verify library. A trained reward model is a reward too: :class:`RewardModelScorer`
(:mod:`~align.rollout.rewards.reward_model`); so is a judge model behind an OpenAI-compatible endpoint, :class:`Judge`
(:mod:`~align.rollout.rewards.judge`), and a service over HTTP, :class:`Remote` (:mod:`~align.rollout.rewards.remote`).

The package: :mod:`~align.rollout.rewards.resolve` turns import paths into objects and points an exception back
into the user's code; :mod:`~align.rollout.rewards.inputs` builds what every reward receives;
:mod:`~align.rollout.rewards.function` calls one reward with its checks; :mod:`~align.rollout.rewards.combine`
combines several with weights and builds an RL run's reward list; :mod:`~align.rollout.rewards.reward_model` makes a
trained reward model a reward; :mod:`~align.rollout.rewards.builtin` holds the built-in rewards;
:mod:`~align.rollout.rewards.service` what the judge and remote rewards share (keys, retries, error counts).
"""

# Besides ``__all__``, ``resolve_import`` (environments and tools use it), ``BASE_INPUTS`` and ``RewardFn`` are
# importable from here.
from align.rollout.rewards.builtin import (
    extract_final_number,
    math_answer,
    sort_exact_match,
    sort_format,
    sort_position_match,
)
from align.rollout.rewards.combine import CombinedReward, training_rewards
from align.rollout.rewards.concurrent import RewardCounts
from align.rollout.rewards.function import RewardError, RewardFunction, RewardSpec
from align.rollout.rewards.inputs import BASE_INPUTS, reward_inputs  # noqa: F401
from align.rollout.rewards.judge import Judge
from align.rollout.rewards.mathverify import math_verify
from align.rollout.rewards.remote import Remote
from align.rollout.rewards.resolve import RewardFn, error_location, one_line, resolve_import, resolve_reward  # noqa: F401
from align.rollout.rewards.reward_model import LazyRewardModel, RewardModelScorer, RewardModelSpec

__all__ = [
    "RewardError",
    "RewardSpec",
    "RewardFunction",
    "CombinedReward",
    "RewardModelSpec",
    "LazyRewardModel",
    "training_rewards",
    "reward_inputs",
    "resolve_reward",
    "sort_exact_match",
    "sort_format",
    "sort_position_match",
    "math_answer",
    "math_verify",
    "extract_final_number",
    "Judge",
    "Remote",
    "RewardCounts",
    "RewardModelScorer",
    "error_location",
    "one_line",
]

"""The bundled multi-turn tasks (docs/environments.md, "Bundled tasks").

* :class:`SortRounds`, for the tiny model: the letter-sorting task of :mod:`align.data.sort_task` played over
  several rounds of one conversation. The row's ``prompt`` is the first round; after each answer the environment
  gives the next round's letters (``rounds``, a column of the data) as a user message, and each round answered
  exactly earns ``1 / number of rounds``. Later rounds are answered with the earlier rounds in the context, which the
  SFT-warmed model never saw: it has to learn to sort the latest letters, not to echo the conversation.
* Arithmetic with a calculator, for the real-model tier: :class:`align.rollout.envs.tools.ToolEnvironment` with
  :func:`align.rollout.envs.tools.calculator` on the bundled arithmetic questions, scored by
  :func:`align.rewards.math_answer` (``configs/grpo/smollm2-calculator.yaml``).
"""

from __future__ import annotations

import random

from align.data import sort_task
from align.rollout.envs.chat import Environment, EnvStep

__all__ = ["SortRounds", "sort_rounds_row"]


class SortRounds(Environment):
    """Letter sorting over rounds: the first from ``prompt``, the next ones from the row's ``rounds`` column (a list
    of ``sort: ...`` prompts). A round's reward is ``1 / rounds`` when its answer is exactly the sorted letters
    (:func:`align.data.sort_task.is_correct`), else 0, so an episode's reward is the share of rounds solved and 1.0
    means all of them. Every round is played whatever the earlier answers were."""

    def reset(self, row: dict) -> list[dict]:
        self.prompts = [row["prompt"], *row.get("rounds", [])]
        self.round = 0
        return row["messages"]

    def step(self, message: dict) -> EnvStep:
        solved = sort_task.is_correct(message["content"], sort_task.solve(self.prompts[self.round]))
        reward = float(solved) / len(self.prompts)
        self.round += 1
        if self.round == len(self.prompts):
            return EnvStep([], reward, True, {"solved_rounds": float(solved)})
        return EnvStep(
            [{"role": "user", "content": self.prompts[self.round]}], reward, False, {"solved_rounds": float(solved)}
        )


def sort_rounds_row(rng: random.Random, rounds: int = 2, min_len: int = 2, max_len: int = 4) -> dict:
    """One row of the multi-turn sort task: ``{"prompt", "rounds", "answer"}`` (``answer``: every round's sorted
    letters, ``|``-separated, for reading). All randomness comes from ``rng``."""
    problems = [sort_task.sample_problem(rng, min_len, max_len) for _ in range(rounds)]
    return {
        "prompt": problems[0]["prompt"],
        "rounds": [p["prompt"] for p in problems[1:]],
        "answer": " | ".join(p["answer"] for p in problems),
    }

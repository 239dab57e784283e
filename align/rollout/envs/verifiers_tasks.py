"""A small verifiers environment that ships with align: letter sorting over rounds (the task of
:class:`align.rollout.envs.tasks.SortRounds`) written against verifiers' classic ``MultiTurnEnv`` and ``Rubric``,
so that ``configs/grpo/tiny-verifiers.yaml`` trains the tiny model on a verifiers environment offline
(docs/environments.md, "verifiers").

A rollout's prompt is a row's first round (``sort: d a c``); its ``info`` column holds the later rounds
(``{"rounds": ["sort: b a"]}``). ``env_response`` gives the next round after each answer, the environment stops
after the last one (``max_turns``), and the rubric's ``sorted_rounds`` is the share of rounds answered with the
sorted letters. :func:`load_environment` is the loader a verifiers hub package exports.
"""

from __future__ import annotations

from typing import Any

from align.data import sort_task
from align.rollout.envs.verifiers import classic_verifiers

__all__ = ["load_environment", "sorted_rounds"]

vf: Any = classic_verifiers()  # verifiers.legacy or verifiers, found at import: its classes are bases here


def _text(message) -> str:
    content = message["content"] if isinstance(message, dict) else message.content
    return content if isinstance(content, str) else ""


def _rounds(prompt, info) -> list[str]:
    first = [_text(m) for m in prompt if (m["role"] if isinstance(m, dict) else m.role) == "user"][-1]
    return [first, *((info or {}).get("rounds") or [])]


def sorted_rounds(prompt, completion, info, **kwargs) -> float:
    """The share of rounds whose answer (the assistant turns, in order) is the sorted letters."""
    rounds = _rounds(prompt, info)
    answers = [_text(m) for m in completion if (m["role"] if isinstance(m, dict) else m.role) == "assistant"]
    solved = sum(sort_task.is_correct(a, sort_task.solve(p)) for a, p in zip(answers, rounds))
    return solved / len(rounds)


class SortRoundsEnv(vf.MultiTurnEnv):
    """The next round's letters after each answer; ``max_turns`` is the number of rounds."""

    async def env_response(self, messages, state, **kwargs):
        rounds = _rounds(state["prompt"], state.get("info"))
        answered = sum(1 for m in messages if (m["role"] if isinstance(m, dict) else m.role) == "assistant")
        return [vf.UserMessage(content=rounds[answered])]


def _examples():
    from datasets import Dataset

    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "sort: b a"}], "answer": "a b", "info": {"rounds": []}}]
    )


def load_environment(rounds: int = 2) -> SortRoundsEnv:
    """The letter-sorting environment over ``rounds`` rounds (align's data gives the rows; the environment's own
    dataset is one example, built only when asked for)."""
    rubric = vf.Rubric(funcs=[sorted_rounds], weights=[1.0])
    return SortRoundsEnv(dataset=_examples, rubric=rubric, max_turns=rounds)

"""The built-in rewards: :func:`sort_exact_match`, :func:`sort_format` and the graded :func:`sort_position_match`
for the bundled sort task (:mod:`align.data.sort_task`), and :func:`math_answer` for GSM8K-style math answers
(:func:`extract_final_number`). Configs name them as ``align.rewards.<name>``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from align.data import sort_task


def sort_exact_match(
    prompts: list[str], completions: list[str], answer: Sequence[str] | None = None, **_: Any
) -> list[float]:
    """1.0 when the completion is exactly the sorted letters, else 0.0 (the bundled sort task).

    Uses the ``answer`` column when the data has one, else solves the prompt.
    """
    answers = list(answer) if answer is not None else [sort_task.solve(p) for p in prompts]
    return [1.0 if sort_task.is_correct(c, a) else 0.0 for c, a in zip(completions, answers)]


def sort_format(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """1.0 when the completion is as many single letters as the prompt, separated by spaces, right or wrong."""
    return [1.0 if sort_task.is_well_formed(c, p) else 0.0 for p, c in zip(prompts, completions)]


def sort_position_match(
    prompts: list[str], completions: list[str], answer: Sequence[str] | None = None, **_: Any
) -> list[float]:
    """Share of the sorted answer's positions that the completion gets right, over the longer of the two; 0.0 when
    the completion is not single letters separated by spaces. Graded, so two wrong completions can still be ranked
    (online DPO, where the binary exact match leaves most pairs tied). 1.0 exactly when ``sort_exact_match`` is 1.

    Uses the ``answer`` column when the data has one, else solves the prompt.
    """
    answers = list(answer) if answer is not None else [sort_task.solve(p) for p in prompts]
    out = []
    for completion, reference in zip(completions, answers):
        got, expected = sort_task.parse_answer(completion), reference.split()
        hits = sum(a == b for a, b in zip(got or [], expected))
        out.append(hits / max(len(got), len(expected)) if got else 0.0)
    return out


_NUMBER = r"-?[\d,]*\.?\d+(?:/\d+)?"
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def extract_final_number(text: str) -> Fraction | None:
    """The final numeric answer of a solution: after ``####``, else inside the last ``\\boxed{}``, else the
    last number in the text. Thousands separators and a trailing period are ignored; ``3/4`` is a fraction.
    Returns ``None`` when there is no number."""
    match = _HASHES.search(text)
    candidate = match.group(1) if match else None
    if candidate is None:
        boxed = _BOXED.findall(text)
        if boxed:
            numbers = _ANY_NUMBER.findall(boxed[-1])
            candidate = numbers[-1] if numbers else None
    if candidate is None:
        numbers = _ANY_NUMBER.findall(text)
        candidate = numbers[-1] if numbers else None
    if candidate is None:
        return None
    try:
        return Fraction(candidate.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def math_answer(
    prompts: list[str], completions: list[str], answer: Sequence[str] | None = None, **_: Any
) -> list[float]:
    """1.0 when the completion's final number equals the reference answer's, numerically, else 0.0.

    The ``answer`` column may be a bare number or a full GSM8K solution ending in ``#### <number>``.
    """
    if answer is None:
        raise ValueError("math_answer needs an 'answer' column in the prompt data")
    out = []
    for completion, reference in zip(completions, answer):
        expected = extract_final_number(str(reference))
        got = extract_final_number(completion)
        out.append(1.0 if expected is not None and got is not None and got == expected else 0.0)
    return out

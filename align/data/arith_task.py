"""The bundled real-model task: small arithmetic questions with a numeric answer.

A prompt asks for one expression of two or three small operands with ``+``, ``-`` or ``*``, in one of a few
phrasings, and asks for the number alone::

    prompt:  "What is 7 + 12? Reply with just the number."
    answer:  "19"

It is the task of the real-model tier (SmolLM2-135M-Instruct): such a model answers part of it correctly
before training (about 30% greedy on the held-out prompts), so every algorithm has a signal and room to improve, and
every completion is checked exactly by :func:`align.rewards.math_answer`, which compares the last number of the
completion with the ``answer`` column.

Rows are made by ``scripts/make_arith_data.py``: ``sft`` (prompt, completion: the bare number),
``preference`` (see :func:`preference_pair`: the worked equation with the right number against the same
equation with a plausible wrong number, or against the right number in chatter) and ``prompts`` (prompt, answer).
Held-out expressions never occur in any training split, in any phrasing.

Pure Python (no torch), like :mod:`align.data.sort_task`.
"""

from __future__ import annotations

import random
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "assets" / "arith"
"""Where the bundled jsonl files live: ``{sft,preference,prompts}/{train,validation}.jsonl``."""

PHRASINGS: tuple[str, ...] = (
    "What is {e}? Reply with just the number.",
    "Compute {e}. Answer with the number only.",
    "{e} = ? Give only the result.",
    "Calculate {e} and reply with only the result.",
    "What does {e} equal? Respond with just the number.",
)
"""Question templates; ``{e}`` is the expression."""


def expression(rng: random.Random) -> str:
    """Draw an expression: ``a + b`` or ``a - b`` (2..20), ``a * b`` (2..12), or three operands (2..9) with
    ``+``/``-``, or ``a * b + c``. All randomness comes from ``rng``."""
    kind = rng.choices(("add", "sub", "mul", "three", "muladd"), weights=(0.3, 0.25, 0.2, 0.15, 0.1))[0]
    if kind == "add":
        return f"{rng.randint(2, 20)} + {rng.randint(2, 20)}"
    if kind == "sub":
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        return f"{max(a, b)} - {min(a, b)}" if rng.random() < 0.8 else f"{a} - {b}"
    if kind == "mul":
        return f"{rng.randint(2, 12)} * {rng.randint(2, 12)}"
    if kind == "three":
        return f"{rng.randint(2, 9)} {rng.choice('+-')} {rng.randint(2, 9)} {rng.choice('+-')} {rng.randint(2, 9)}"
    return f"{rng.randint(2, 9)} * {rng.randint(2, 9)} + {rng.randint(2, 9)}"


def evaluate(expr: str) -> int:
    """The value of an expression made by :func:`expression` (integers, ``+ - *``, usual precedence)."""
    tokens = expr.split()
    if (
        len(tokens) % 2 == 0
        or any(not t.lstrip("-").isdigit() for t in tokens[::2])
        or any(t not in ("+", "-", "*") for t in tokens[1::2])
    ):
        raise ValueError(f"malformed expression {expr!r}; expected e.g. '3 + 4 * 2'")
    terms: list[int] = [int(tokens[0])]
    for op, value in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            terms[-1] *= int(value)
        else:
            terms.append(int(value) if op == "+" else -int(value))
    return sum(terms)


def make_prompt(expr: str, phrasing: int) -> str:
    return PHRASINGS[phrasing].format(e=expr)


def sample_problem(rng: random.Random) -> dict[str, str]:
    """``{"prompt", "answer", "expression"}`` for one random expression and phrasing."""
    expr = expression(rng)
    return {
        "prompt": make_prompt(expr, rng.randrange(len(PHRASINGS))),
        "answer": str(evaluate(expr)),
        "expression": expr,
    }


def tool_expression(rng: random.Random) -> str:
    """Draw an expression too large to do in one's head, for the calculator task: ``a * b`` (a three-digit number
    times a two-digit one), or a sum or difference of two numbers of three or four digits."""
    kind = rng.choices(("mul", "add", "sub"), weights=(0.5, 0.25, 0.25))[0]
    if kind == "mul":
        return f"{rng.randint(101, 999)} * {rng.randint(11, 99)}"
    a, b = rng.randint(101, 9999), rng.randint(101, 9999)
    return f"{a} + {b}" if kind == "add" else f"{max(a, b)} - {min(a, b)}"


def sample_tool_problem(rng: random.Random) -> dict[str, str]:
    """``{"prompt", "answer", "expression"}`` for one :func:`tool_expression` and phrasing."""
    expr = tool_expression(rng)
    return {
        "prompt": make_prompt(expr, rng.randrange(len(PHRASINGS))),
        "answer": str(evaluate(expr)),
        "expression": expr,
    }


def wrong_number(rng: random.Random, expr: str) -> int:
    """A plausible mistake: off by a little, an operator misread, or the digits swapped; never the answer."""
    right = evaluate(expr)
    for _ in range(100):
        kind = rng.random()
        if kind < 0.5:
            got = right + rng.choice((-3, -2, -1, 1, 2, 3, 10, -10))
        elif kind < 0.8:
            ops = [i for i, t in enumerate(expr.split()) if t in "+-*"]
            tokens = expr.split()
            i = rng.choice(ops)
            tokens[i] = rng.choice([o for o in "+-*" if o != tokens[i]])
            got = evaluate(" ".join(tokens))
        else:
            got = int(str(abs(right))[::-1]) * (1 if right >= 0 else -1)
        if got != right:
            return got
    return right + 1


ANSWER_FORMAT = "{e} = {n}"
"""A well-formatted answer: the worked equation ending in the number (``7 + 12 = 19``), short, with the result
last, where :func:`align.rewards.math_answer` reads it. It is also the form in which SmolLM2-135M-Instruct
does its arithmetic: asked for the bare number, it answers ``7 + 12 = 19`` more often than not, and its bare
numbers are far less often right, so a preference for bare numbers teaches it to stop computing."""

_CHATTER = (
    "Sure! Let me work that out. {e} = {n}. I hope this helps, let me know if you have another question!",
    "Great question! To find the answer we compute {e}, which gives us {n}. So the final answer is {n}.",
    "Okay, here is the result you asked for: {n}. Arithmetic like this is easy once you practise it.",
)

CHATTER_SHARE = 0.15
"""Share of preference pairs that differ in format rather than correctness."""


def preference_pair(rng: random.Random, expr: str) -> tuple[str, str]:
    """``(chosen, rejected)`` for one expression; the chosen is always the right :data:`ANSWER_FORMAT` answer.

    Most pairs (``1 - CHATTER_SHARE``) differ only in correctness: the rejected is the same equation ending in a
    plausible wrong number (:func:`wrong_number`), so a model trained on them learns to get the number right
    rather than to change how it writes. The rest differ only in format: the rejected has the right number
    buried in chatter that ignores "reply with just the number".
    """
    right = evaluate(expr)
    chosen = ANSWER_FORMAT.format(e=expr, n=right)
    if rng.random() < CHATTER_SHARE:
        return chosen, rng.choice(_CHATTER).format(e=expr, n=right)
    return chosen, ANSWER_FORMAT.format(e=expr, n=wrong_number(rng, expr))


__all__ = [
    "ANSWER_FORMAT",
    "CHATTER_SHARE",
    "DATA_DIR",
    "PHRASINGS",
    "evaluate",
    "expression",
    "make_prompt",
    "preference_pair",
    "sample_problem",
    "sample_tool_problem",
    "tool_expression",
    "wrong_number",
]

"""The bundled task: sort a handful of letters.

A prompt lists letters drawn with replacement from ``a``..``j`` and the answer
is the same letters in ascending order, duplicates kept::

    prompt:  "sort: d a c b a"
    answer:  "a a b c d"

It is the embedded default's task because a tiny model learns it on a laptop
CPU in minutes, and every completion can be checked exactly: it is either the
sorted list or it is not. That makes it usable for all algorithms at once: SFT
trains on ``(prompt, answer)``, DPO and the reward model on a correct answer
against a checkably wrong one, and GRPO/PPO on the prompts with
:func:`is_correct` as the reward.

This module is pure Python (no torch) so that reward functions and the data
generator (``scripts/make_bundled_data.py``) can import it cheaply. Prompts
here are the plain task strings; the data layer applies the chat template.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path

LETTERS: tuple[str, ...] = tuple("abcdefghij")
"""The alphabet letters are drawn from."""

PROMPT_PREFIX = "sort:"

DATA_DIR = Path(__file__).resolve().parent / "assets" / "sort"
"""Where the bundled jsonl files live: ``{sft,preference,prompts}/{train,validation}.jsonl``."""

_PROMPT_RE = re.compile(r"sort:((?: [a-z])+)")
_ANSWER_RE = re.compile(r"[a-z](?: [a-z])*")


def data_file(kind: str, split: str) -> Path:
    """Path of a bundled jsonl file, e.g. ``data_file("sft", "train")``.

    ``kind`` is ``"sft"``, ``"preference"`` or ``"prompts"``; ``split`` is
    ``"train"`` or ``"validation"``.
    """
    if kind not in ("sft", "preference", "prompts"):
        raise ValueError(f"unknown bundled data kind {kind!r}; expected 'sft', 'preference' or 'prompts'")
    if split not in ("train", "validation"):
        raise ValueError(f"unknown bundled split {split!r}; expected 'train' or 'validation'")
    return DATA_DIR / kind / f"{split}.jsonl"


def make_prompt(letters: Sequence[str]) -> str:
    """``["d", "a", "c"]`` -> ``"sort: d a c"``."""
    if not letters:
        raise ValueError("a sort prompt needs at least one letter")
    bad = [x for x in letters if x not in LETTERS]
    if bad:
        raise ValueError(f"letters must come from {''.join(LETTERS)!r}; got {bad!r}")
    return f"{PROMPT_PREFIX} " + " ".join(letters)


def prompt_letters(prompt: str) -> list[str]:
    """The letters of a prompt, in prompt order. Raises ``ValueError`` on a malformed prompt."""
    match = _PROMPT_RE.fullmatch(prompt.strip())
    if match is None:
        raise ValueError(f"malformed sort prompt {prompt!r}; expected e.g. 'sort: d a c b'")
    letters = match.group(1).split()
    bad = [x for x in letters if x not in LETTERS]
    if bad:
        raise ValueError(f"malformed sort prompt {prompt!r}: letters {bad!r} are outside {''.join(LETTERS)!r}")
    return letters


def solve(prompt: str) -> str:
    """The correct answer string: ``"sort: d a c"`` -> ``"a c d"``."""
    return " ".join(sorted(prompt_letters(prompt)))


def sample_problem(rng: random.Random, min_len: int = 3, max_len: int = 6) -> dict[str, str]:
    """Draw one problem: a length uniform in ``[min_len, max_len]``, letters with replacement.

    Returns ``{"prompt": ..., "answer": ...}``. All randomness comes from ``rng``.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len; got min_len={min_len}, max_len={max_len}")
    n = rng.randint(min_len, max_len)
    letters = [rng.choice(LETTERS) for _ in range(n)]
    return {"prompt": make_prompt(letters), "answer": " ".join(sorted(letters))}


def parse_answer(completion: str) -> list[str] | None:
    """Letters of a completion, or ``None`` if it is not single letters separated by single spaces.

    Surrounding whitespace is ignored. Letters outside the alphabet still parse
    (so that :func:`is_well_formed` can tell "wrong letter" from "not a list").
    """
    text = completion.strip()
    if _ANSWER_RE.fullmatch(text) is None:
        return None
    return text.split(" ")


def is_correct(completion: str, answer: str | Sequence[str]) -> bool:
    """Whether ``completion`` is exactly the sorted list ``answer`` (a string ``"a b c"`` or a list)."""
    expected = answer.split() if isinstance(answer, str) else list(answer)
    return parse_answer(completion) == expected


def is_well_formed(completion: str, prompt: str) -> bool:
    """Whether ``completion`` has the right shape for ``prompt``, right or wrong.

    Well-formed means single letters from the alphabet, separated by single
    spaces, as many as the prompt has. Raises ``ValueError`` on a malformed prompt.
    """
    n = len(prompt_letters(prompt))
    letters = parse_answer(completion)
    return letters is not None and len(letters) == n and all(x in LETTERS for x in letters)

"""Generate the bundled letter-sorting datasets under ``align/data/assets/sort/``.

    python scripts/make_bundled_data.py [--out-dir DIR]

Writes, from one fixed seed, byte-identical files on every run::

    sft/{train,validation}.jsonl         {"completion", "prompt"}
    preference/{train,validation}.jsonl  {"chosen", "prompt", "rejected"}
    prompts/{train,validation}.jsonl     {"answer", "prompt"}

The validation prompts are drawn first; every train split then rejects any
prompt held out by any validation split, so held-out numbers never measure
memorisation. Prompts are unique within a validation file; train files may
repeat a prompt (there are only 1,000 distinct length-3 prompts).

Rejected answers are wrong in a way a checker can see:
  - swap (70%): the sorted list with two adjacent distinct letters swapped;
  - echo (10%): the unsorted input copied back;
  - drop (10%): the sorted list missing one letter;
  - dup  (10%): the sorted list with one letter doubled.
When a kind cannot produce a wrong answer (``a a a`` has no distinct neighbours
to swap, a sorted input echoes the right answer) the next kind that can is used.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from align.data.sort_task import prompt_letters, sample_problem

SEED = 1729
SIZES = {
    ("sft", "train"): 4000,
    ("sft", "validation"): 200,
    ("preference", "train"): 2000,
    ("preference", "validation"): 200,
    ("prompts", "train"): 2000,
    ("prompts", "validation"): 100,
}
KINDS = ("sft", "preference", "prompts")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "align" / "data" / "assets" / "sort"


def _swap(rng: random.Random, letters: list[str]) -> str | None:
    ordered = sorted(letters)
    spots = [i for i in range(len(ordered) - 1) if ordered[i] != ordered[i + 1]]
    if not spots:
        return None
    i = rng.choice(spots)
    ordered[i], ordered[i + 1] = ordered[i + 1], ordered[i]
    return " ".join(ordered)


def _echo(rng: random.Random, letters: list[str]) -> str | None:
    if letters == sorted(letters):
        return None
    return " ".join(letters)


def _drop(rng: random.Random, letters: list[str]) -> str | None:
    ordered = sorted(letters)
    if len(ordered) < 2:
        return None
    del ordered[rng.randrange(len(ordered))]
    return " ".join(ordered)


def _dup(rng: random.Random, letters: list[str]) -> str | None:
    ordered = sorted(letters)
    i = rng.randrange(len(ordered))
    ordered.insert(i, ordered[i])
    return " ".join(ordered)


# Order matters for the fallback: a kind that cannot corrupt this input hands over to the next one.
_CORRUPTIONS = ((0.7, _swap), (0.1, _echo), (0.1, _drop), (0.1, _dup))


def corrupt(rng: random.Random, prompt: str) -> str:
    """A plausible, checkably wrong answer to ``prompt``."""
    letters = prompt_letters(prompt)
    u, start = rng.random(), 0
    for k, (p, _) in enumerate(_CORRUPTIONS):
        if u < p:
            start = k
            break
        u -= p
    for k in range(len(_CORRUPTIONS)):
        rejected = _CORRUPTIONS[(start + k) % len(_CORRUPTIONS)][1](rng, letters)
        if rejected is not None:
            return rejected
    raise AssertionError(f"no corruption applies to {prompt!r}")  # _dup always applies


def _row(kind: str, rng: random.Random, problem: dict[str, str]) -> dict[str, str]:
    prompt, answer = problem["prompt"], problem["answer"]
    if kind == "sft":
        return {"prompt": prompt, "completion": answer}
    if kind == "preference":
        rejected = corrupt(rng, prompt)
        assert rejected != answer, (prompt, rejected)
        return {"prompt": prompt, "chosen": answer, "rejected": rejected}
    return {"prompt": prompt, "answer": answer}


def build(seed: int = SEED) -> dict[tuple[str, str], list[dict[str, str]]]:
    """All six splits as lists of rows, validation prompts disjoint from every train split."""
    out: dict[tuple[str, str], list[dict[str, str]]] = {}
    held_out: set[str] = set()
    # One stream per split, so resizing one split leaves the others unchanged.
    for i, kind in enumerate(KINDS):
        rng = random.Random(seed * 100 + 2 * i + 1)
        rows, seen = [], set()
        while len(rows) < SIZES[kind, "validation"]:
            problem = sample_problem(rng)
            if problem["prompt"] in seen:
                continue
            seen.add(problem["prompt"])
            rows.append(_row(kind, rng, problem))
        held_out |= seen
        out[kind, "validation"] = rows
    for i, kind in enumerate(KINDS):
        rng = random.Random(seed * 100 + 2 * i)
        rows = []
        while len(rows) < SIZES[kind, "train"]:
            problem = sample_problem(rng)
            if problem["prompt"] in held_out:
                continue
            rows.append(_row(kind, rng, problem))
        out[kind, "train"] = rows
    return out


def write(out_dir: Path, seed: int = SEED) -> list[Path]:
    written = []
    for (kind, split), rows in sorted(build(seed).items()):
        path = out_dir / kind / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help="where to write the jsonl files")
    parser.add_argument("--seed", type=int, default=SEED, help="change only to make a different dataset")
    args = parser.parse_args()
    for path in write(args.out_dir, args.seed):
        print(path)


if __name__ == "__main__":
    main()

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

Rejected answers are wrong in a way a checker can see, and cover the mistakes a
partly trained policy makes (so that a reward model trained on them can rank its samples):
  - edit (65%): the right letters with 1 to 3 random edits (a letter substituted,
    inserted or deleted; 1 edit 60%, 2 edits 30%, 3 edits 10%), sorted again:
    a well-ordered answer with the wrong letters;
  - swap (25%): the sorted list with two adjacent distinct letters swapped;
  - echo (10%): the unsorted input copied back.
When a kind cannot produce a wrong answer (``a a a`` has no distinct neighbours
to swap, a sorted input echoes the right answer) the next kind that can is used.
Rejected answers come from their own random stream, so the choice of prompts
(and with it every other split) does not depend on how answers are corrupted.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from align.data.sort_task import LETTERS, prompt_letters, sample_problem

SEED = 1729
SIZES = {
    ("sft", "train"): 4000,
    ("sft", "validation"): 200,
    ("preference", "train"): 10000,
    ("preference", "validation"): 200,
    ("prompts", "train"): 2000,
    ("prompts", "validation"): 100,
}
KINDS = ("sft", "preference", "prompts")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "align" / "data" / "assets" / "sort"


def _edit(rng: random.Random, letters: list[str]) -> str | None:
    ordered = sorted(letters)
    edits = rng.choices((1, 2, 3), weights=(0.6, 0.3, 0.1))[0]
    for _ in range(100):  # an insertion and a deletion can cancel out; draw again
        out = list(ordered)
        for _ in range(edits):
            op = rng.choice(("sub", "ins", "del") if len(out) > 1 else ("sub", "ins"))
            if op == "sub":
                i = rng.randrange(len(out))
                out[i] = rng.choice([x for x in LETTERS if x != out[i]])
            elif op == "ins":
                out.append(rng.choice(LETTERS))
            else:
                del out[rng.randrange(len(out))]
        out.sort()
        if out != ordered:
            return " ".join(out)
    return None


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


# Order matters for the fallback: a kind that cannot corrupt this input hands over to the next one.
_CORRUPTIONS = ((0.65, _edit), (0.25, _swap), (0.10, _echo))


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
    raise AssertionError(f"no corruption applies to {prompt!r}")  # _edit always applies


def _row(kind: str, wrong: random.Random, problem: dict[str, str]) -> dict[str, str]:
    prompt, answer = problem["prompt"], problem["answer"]
    if kind == "sft":
        return {"prompt": prompt, "completion": answer}
    if kind == "preference":
        rejected = corrupt(wrong, prompt)
        assert rejected != answer, (prompt, rejected)
        return {"prompt": prompt, "chosen": answer, "rejected": rejected}
    return {"prompt": prompt, "answer": answer}


def draw_splits(
    seed: int, sizes: dict[tuple[str, str], int], kinds: tuple[str, ...], sample, make_row, key
) -> dict[tuple[str, str], list[dict]]:
    """Every ``(kind, split)`` of a task, held-out problems (by ``key(problem)``) disjoint from every train split.

    ``sample(rng) -> problem``; ``make_row(kind, wrong_rng, problem) -> row``. Validation problems are drawn
    first and are unique within a file. One stream of problems per split, so resizing one split leaves the
    others unchanged, and a second stream per split for the rejected answers, so how they are made never
    changes which problems are drawn.
    """
    out: dict[tuple[str, str], list[dict]] = {}
    held_out: set = set()
    for i, kind in enumerate(kinds):
        rng, wrong = random.Random(seed * 100 + 2 * i + 1), random.Random(seed * 100 + 50 + 2 * i + 1)
        rows, seen = [], set()
        while len(rows) < sizes[kind, "validation"]:
            problem = sample(rng)
            if key(problem) in seen:
                continue
            seen.add(key(problem))
            rows.append(make_row(kind, wrong, problem))
        held_out |= seen
        out[kind, "validation"] = rows
    for i, kind in enumerate(kinds):
        rng, wrong = random.Random(seed * 100 + 2 * i), random.Random(seed * 100 + 50 + 2 * i)
        rows = []
        while len(rows) < sizes[kind, "train"]:
            problem = sample(rng)
            if key(problem) not in held_out:
                rows.append(make_row(kind, wrong, problem))
        out[kind, "train"] = rows
    return out


def build(seed: int = SEED) -> dict[tuple[str, str], list[dict[str, str]]]:
    """All six splits as lists of rows, validation prompts disjoint from every train split."""
    return draw_splits(seed, SIZES, KINDS, sample_problem, _row, key=lambda problem: problem["prompt"])


def write_splits(out_dir: Path, splits: dict[tuple[str, str], list[dict]]) -> list[Path]:
    """Write ``{(kind, split): rows}`` as ``out_dir/<kind>/<split>.jsonl``, keys sorted, one row a line."""
    written = []
    for (kind, split), rows in sorted(splits.items()):
        path = out_dir / kind / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        written.append(path)
    return written


def write(out_dir: Path, seed: int = SEED) -> list[Path]:
    return write_splits(out_dir, build(seed))


def run_main(doc: str, default_out: Path, seed: int, build_splits) -> None:
    """The command line every data script shares: ``--out-dir`` and ``--seed``, then the written paths."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=default_out, help="where to write the jsonl files")
    parser.add_argument("--seed", type=int, default=seed, help="change only to make a different dataset")
    args = parser.parse_args()
    for path in write_splits(args.out_dir, build_splits(args.seed)):
        print(path)


def main() -> None:
    run_main(__doc__, DEFAULT_OUT, SEED, build)


if __name__ == "__main__":
    main()

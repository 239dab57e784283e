"""Generate the bundled arithmetic datasets under ``align/data/assets/arith/`` (the real-model tier's task).

    python scripts/make_arith_data.py [--out-dir DIR]

Writes, from one fixed seed, byte-identical files on every run::

    sft/{train,validation}.jsonl         {"completion", "prompt"}            completion: the bare number
    preference/{train,validation}.jsonl  {"chosen", "prompt", "rejected"}    see align.data.arith_task
    prompts/{train,validation}.jsonl     {"answer", "prompt"}                scored by align.rewards.math_answer

Validation expressions are drawn first, unique within each file; no training row of any kind uses a held-out
expression, in any phrasing, so held-out accuracy measures arithmetic rather than memorised questions.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_bundled_data import draw_splits, run_main, write_splits  # noqa: E402, F401  (write_splits: the tests call it here)

from align.data.arith_task import preference_pair, sample_problem  # noqa: E402

SEED = 2024
SIZES = {
    ("sft", "train"): 2000,
    ("sft", "validation"): 200,
    ("preference", "train"): 2000,
    ("preference", "validation"): 200,
    ("prompts", "train"): 2000,
    ("prompts", "validation"): 200,
}
KINDS = ("sft", "preference", "prompts")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "align" / "data" / "assets" / "arith"


def _row(kind: str, wrong: random.Random, problem: dict[str, str]) -> dict[str, str]:
    prompt, answer = problem["prompt"], problem["answer"]
    if kind == "sft":
        return {"prompt": prompt, "completion": answer}
    if kind == "preference":
        chosen, rejected = preference_pair(wrong, problem["expression"])
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    return {"prompt": prompt, "answer": answer}


def build(seed: int = SEED) -> dict[tuple[str, str], list[dict[str, str]]]:
    """All six splits; held-out expressions are disjoint from every train split."""
    return draw_splits(seed, SIZES, KINDS, sample_problem, _row, key=lambda problem: problem["expression"])


def main() -> None:
    run_main(__doc__, DEFAULT_OUT, SEED, build)


if __name__ == "__main__":
    main()

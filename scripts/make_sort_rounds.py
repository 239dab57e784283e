"""Generate the bundled multi-turn sorting task under ``align/data/assets/sort/rounds/``.

    python scripts/make_sort_rounds.py [--out-dir DIR]

Writes, from one fixed seed, byte-identical files on every run::

    rounds/{train,validation}.jsonl     {"answer", "prompt", "rounds"}

Each row is an episode of :class:`align.rollout.envs.tasks.SortRounds`: two rounds of 2 to 4 letters, the first in
``prompt`` and the second in ``rounds``. No held-out episode (its sequence of prompts) occurs in the train split.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_bundled_data import DEFAULT_OUT, draw_splits, run_main, write_splits  # noqa: E402, F401  (write_splits: the tests call it here)

from align.rollout.envs.tasks import sort_rounds_row  # noqa: E402

SEED = 2718
SIZES = {("rounds", "train"): 2000, ("rounds", "validation"): 100}


def build(seed: int = SEED) -> dict[tuple[str, str], list[dict]]:
    return draw_splits(
        seed,
        SIZES,
        ("rounds",),
        lambda rng: sort_rounds_row(rng, rounds=2, min_len=2, max_len=4),
        lambda kind, wrong, row: row,
        key=lambda row: (row["prompt"], *row["rounds"]),
    )


def main() -> None:
    run_main(__doc__, DEFAULT_OUT, SEED, build)


if __name__ == "__main__":
    main()

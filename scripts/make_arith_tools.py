"""Generate the bundled calculator task under ``align/data/assets/arith/tools/`` (the real-model tier's tool task).

    python scripts/make_arith_tools.py [--out-dir DIR]

Writes, from one fixed seed, byte-identical files on every run::

    tools/{train,validation}.jsonl     {"answer", "prompt"}     scored by align.rewards.math_answer

The expressions (:func:`align.data.arith_task.tool_expression`: a three-digit number times a two-digit one, or a
sum or difference of numbers of three or four digits) are beyond what SmolLM2-135M-Instruct does in its head, so
the held-out accuracy measures how well it uses the calculator. No held-out expression occurs in the train split.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_bundled_data import draw_splits, run_main, write_splits  # noqa: E402, F401  (write_splits: the tests call it here)

from align.data.arith_task import DATA_DIR, sample_tool_problem  # noqa: E402

SEED = 4242
SIZES = {("tools", "train"): 2000, ("tools", "validation"): 200}


def build(seed: int = SEED) -> dict[tuple[str, str], list[dict]]:
    return draw_splits(
        seed,
        SIZES,
        ("tools",),
        sample_tool_problem,
        lambda kind, wrong, p: {"prompt": p["prompt"], "answer": p["answer"]},
        key=lambda p: p["expression"],
    )


def main() -> None:
    run_main(__doc__, DATA_DIR, SEED, build)


if __name__ == "__main__":
    main()

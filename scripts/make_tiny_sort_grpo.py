"""Rebuild the shipped ``tiny-sort-grpo`` teacher: ``tiny-sort`` after the GRPO recipe's default run.

The distillation recipe's embedded default (``python recipes/distill.py``) distils this model into ``tiny-sort``.
It is ``recipes/grpo.py`` with no settings changed (``configs/grpo/tiny.yaml``: 100 on-policy steps from
``tiny-sort``), reproduced exactly (same machine kind, same library versions, same thread count) by:

    python scripts/make_tiny_sort_grpo.py

which runs the recipe, exports its last checkpoint with ``align export`` semantics into
``align/hub/assets/tiny-sort-grpo/`` and records the settings and the greedy held-out exact match in
``training_args.json``. ``--max_steps`` and ``--output`` exist for tests and experiments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_tiny_sort import greedy_exact_match, train_and_export  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "align" / "hub" / "assets" / "tiny-sort-grpo"


def grpo_args(work_dir: Path, max_steps: int | None = None) -> list[str]:
    """The recipe's command-line overrides (the recipe default, ``configs/grpo/tiny.yaml``, otherwise)."""
    args = [
        "--trainer.default_root_dir",
        str(work_dir),
        "--trainer.enable_progress_bar",
        "false",
        "--seed_everything",
        "0",
    ]
    if max_steps is not None:
        args += ["--trainer.max_steps", str(max_steps)]
    return args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=None, help="Stop after this many optimizer steps.")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="Directory of the exported model.")
    parser.add_argument("--work_dir", type=Path, default=None, help="Where the GRPO run writes (default: a temp dir).")
    parser.add_argument("--eval_limit", type=int, default=None, help="Evaluate on the first N held-out prompts.")
    ns = parser.parse_args(argv)

    out = train_and_export("grpo.py", lambda work: grpo_args(work, ns.max_steps), ns.output, ns.work_dir, "last.ckpt")
    accuracy = greedy_exact_match(out, ns.eval_limit)
    (out / "training_args.json").write_text(
        json.dumps(
            {
                "recipe": "recipes/grpo.py",
                "args": grpo_args(Path("<work_dir>"), ns.max_steps),
                "greedy_val_exact_match": accuracy,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"exported to {out}; greedy held-out exact match {accuracy:.3f}")


if __name__ == "__main__":
    main()

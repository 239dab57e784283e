"""Rebuild the shipped ``tiny-sort-rm`` reward model: ``recipes/rm.py`` on the bundled sort preferences.

PPO on the embedded default (``python recipes/ppo.py``) is rewarded by this model and starts its critic from
it. It is the reward-model recipe's own default run (``configs/rm/tiny.yaml``: started from ``tiny-sort``, two
epochs over ``align:sort/preference/train.jsonl``), reproduced exactly (same machine kind, same library
versions) by:

    python scripts/make_tiny_sort_rm.py

which runs the recipe, copies its export (``<run dir>/export``, see :mod:`align.models.reward_export`) into
``align/hub/assets/tiny-sort-rm/`` and records the settings and the held-out pair accuracy in
``training_args.json``. ``--max_steps`` and ``--output`` exist for tests and experiments.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "align" / "hub" / "assets" / "tiny-sort-rm"


def rm_args(work_dir: Path, max_steps: int | None = None) -> list[str]:
    """The recipe's command-line overrides (the recipe default, ``configs/rm/tiny.yaml``, otherwise)."""
    args = [
        "--trainer.default_root_dir",
        str(work_dir),
        "--trainer.enable_checkpointing",
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
    parser.add_argument("--work_dir", type=Path, default=None, help="Where the RM run writes (default: a temp dir).")
    ns = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        work = ns.work_dir or Path(tmp)
        cmd = [sys.executable, str(ROOT / "recipes" / "rm.py"), *rm_args(work, ns.max_steps)]
        print("running:", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
        print(proc.stdout[-2000:], flush=True)
        exports = sorted(work.rglob("export/reward_model.json"), key=lambda p: p.stat().st_mtime)
        if not exports:
            raise SystemExit(f"no reward-model export written under {work}")
        if ns.output.exists():
            shutil.rmtree(ns.output)
        shutil.copytree(exports[-1].parent, ns.output)
    match = re.search(r"val/rm_accuracy: ([0-9.]+) -> ([0-9.]+)", proc.stdout + proc.stderr)
    accuracy = float(match.group(2)) if match else None
    (ns.output / "training_args.json").write_text(
        json.dumps(
            {
                "recipe": "recipes/rm.py",
                "config": "configs/rm/tiny.yaml",
                "args": rm_args(Path("<work_dir>"), ns.max_steps),
                "val_rm_accuracy": accuracy,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"exported to {ns.output}; held-out pair accuracy {accuracy}")


if __name__ == "__main__":
    main()

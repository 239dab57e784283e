"""Rebuild the shipped ``tiny-sort`` policy: the embedded tiny Llama warm-started by the SFT recipe.

GRPO and PPO on the embedded default start from this policy, so they begin from a model that solves the
bundled sort task some of the time (about half of the held-out prompts, greedily) and has headroom to improve.
The weights are reproduced exactly (same machine kind, same library versions) by:

    python scripts/make_tiny_sort.py

which runs ``recipes/sft.py`` with the fixed settings below, exports the final checkpoint with ``align
export`` semantics into ``align/hub/assets/tiny-sort/`` and prints the greedy held-out exact match.
``--steps`` and ``--output`` exist for tests and experiments.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "align" / "hub" / "assets" / "tiny-sort"
STEPS = 50
"""SFT optimizer steps of the shipped weights (batch 32, lr 1e-3)."""


def sft_args(steps: int, work_dir: Path) -> list[str]:
    """The recipe's command-line overrides: the fixed settings of the shipped weights."""
    return [
        "--trainer.max_steps",
        str(steps),
        "--trainer.max_epochs",
        "-1",
        "--trainer.default_root_dir",
        str(work_dir),
        "--trainer.log_every_n_steps",
        "10",
        "--trainer.enable_checkpointing",
        "true",
        "--model.init_args.optimizer.init_args.lr",
        "1.0e-3",
        "--model.init_args.scheduler.init_args.warmup_steps",
        "10",
        "--data.init_args.batch_size",
        "32",
        "--eval_before_after",
        "false",
        "--seed_everything",
        "0",
    ]


def greedy_exact_match(model_dir: Path, limit: int | None = None) -> float:
    """Share of held-out sort prompts that the model at ``model_dir`` answers exactly, greedily."""
    import torch

    from align.data.chat import ChatEncoder
    from align.data.io import read_rows
    from align.data.sort_task import is_correct
    from align.models.policy import PolicyModel
    from align.rollout.engine import make_engine

    policy = PolicyModel(str(model_dir))
    rows = read_rows("align:sort/prompts/validation.jsonl")[:limit]
    encoder = ChatEncoder(policy.tokenizer)
    prompts = [encoder.prompt_ids([{"role": "user", "content": r["prompt"]}]) for r in rows]
    engine = make_engine(max_new_tokens=16, temperature=0.0)
    with torch.inference_mode():
        rollout = engine.generate(policy, prompts)
    return sum(is_correct(text, r["answer"]) for text, r in zip(rollout.texts, rows)) / len(rows)


def train_and_export(recipe: str, args, output: Path, work_dir: Path | None, checkpoint: str = "*.ckpt") -> Path:
    """Run ``recipes/<recipe>`` with ``args(work_dir)`` (a temporary folder when ``work_dir`` is None) and export its
    newest checkpoint named like ``checkpoint`` with ``align export`` semantics into ``output``; returns it."""
    with tempfile.TemporaryDirectory() as tmp:
        work = work_dir or Path(tmp)
        cmd = [sys.executable, str(ROOT / "recipes" / recipe), *args(work)]
        print("running:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
        checkpoints = sorted(work.rglob(checkpoint), key=lambda p: p.stat().st_mtime)
        if not checkpoints:
            raise SystemExit(f"no checkpoint written under {work}")
        from align.models.export import export_checkpoint

        return export_checkpoint(checkpoints[-1], output)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="SFT optimizer steps.")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="Directory of the exported model.")
    parser.add_argument("--work_dir", type=Path, default=None, help="Where the SFT run writes (default: a temp dir).")
    parser.add_argument("--eval_limit", type=int, default=None, help="Evaluate on the first N held-out prompts.")
    ns = parser.parse_args(argv)

    out = train_and_export("sft.py", lambda work: sft_args(ns.steps, work), ns.output, ns.work_dir)
    accuracy = greedy_exact_match(out, ns.eval_limit)
    (out / "training_args.json").write_text(
        json.dumps(
            {
                "recipe": "recipes/sft.py",
                "steps": ns.steps,
                "args": sft_args(ns.steps, Path("<work_dir>")),
                "greedy_val_exact_match": accuracy,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"exported to {out}; greedy held-out exact match {accuracy:.3f}")


if __name__ == "__main__":
    main()

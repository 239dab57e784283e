"""Two runs at one seed log the same numbers, bit for bit, at 2 threads: GRPO, PPO and DPO (their scoring passes
run shared prompt tokens once, :mod:`align.models.shared_pass`, whose gradient sums rows that share a position)."""

import csv
import sys
from pathlib import Path

import pytest

from align.cli.recipes import run_recipe
from align.data.preference import PreferenceDataModule
from align.data.prompts import PromptDataModule
from align.modules.dpo import DPOModule
from align.modules.grpo import GRPOModule
from align.modules.ppo import PPOModule

SORT = Path(__file__).resolve().parents[2] / "align" / "data" / "assets" / "sort"
# Wall-clock metrics differ between any two runs.
TIMING = ("_per_s", "time/")
QUIET = [
    "--trainer.limit_val_batches",
    "0",
    "--eval_before_after",
    "false",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.log_every_n_steps",
    "1",
]
# Rows x fed tokens x hidden width of each pass is above torch's CPU grain size (32768 elements), where the
# gradient of advanced indexing adds in parallel with atomics.
RUNS = {
    "grpo": (
        GRPOModule,
        PromptDataModule,
        "prompts",
        [
            "--trainer.max_steps",
            "2",
            "--data.batch_size",
            "4",
            "--model.group_size",
            "8",
            "--model.sampling.max_new_tokens",
            "12",
        ],
    ),
    "ppo": (
        PPOModule,
        PromptDataModule,
        "prompts",
        [
            "--trainer.max_steps",
            "2",
            "--data.batch_size",
            "8",
            "--model.updates.epochs",
            "1",
            "--model.updates.minibatches",
            "1",
            "--model.value.warmup_rollouts",
            "0",
        ],
    ),
    "dpo": (DPOModule, PreferenceDataModule, "preference", ["--trainer.max_steps", "2", "--data.batch_size", "16"]),
}


def logged(root) -> list[dict[str, str]]:
    (path,) = root.rglob("metrics.csv")
    rows = list(csv.DictReader(path.read_text().splitlines()))
    return [{k: v for k, v in row.items() if v != "" and not any(t in k for t in TIMING)} for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", list(RUNS))
def test_two_runs_at_one_seed_log_the_same_values_at_two_threads(algorithm, tmp_path, monkeypatch, two_threads):
    module, data, task, args = RUNS[algorithm]
    train = tmp_path / "train.jsonl"  # the first rows: no reference pass over the whole file
    train.write_text("".join((SORT / task / "train.jsonl").read_text().splitlines(keepends=True)[:32]))
    args = [*args, "--data.train_files", str(train), "--data.val_files", "null"]
    monkeypatch.setattr(sys, "argv", [sys.argv[0]])
    runs = []
    for name in ("first", "second"):
        run_recipe(algorithm, module, data, args=[*args, *QUIET, "--trainer.default_root_dir", str(tmp_path / name)])
        runs.append(logged(tmp_path / name))
    first, second = runs
    assert sum(len(row) for row in first) > 3 * len(first) and any(k.startswith("train/") for k in first[-1]), first
    assert first == second

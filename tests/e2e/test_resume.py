"""Exact resume after SIGKILL: a run killed at a random step after a checkpoint (or in the middle of writing
one) and resumed with ``--ckpt_path last`` logs the same metrics, bit for bit, as a run that was never
interrupted, in the same run folder (``version_0``).

Each run is its own process (``_run.py``), at 2 threads with torch's default kernels. The kill lands after an
optimizer step whose checkpoint is not written yet, so the resumed run repeats the steps since the previous
checkpoint: the data position, the RNG streams (rollout sampling included), the optimizer, the schedule and
the loop counters must all come back for the numbers to match. Every setting crosses an epoch boundary.
"""

import csv
import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from align.trainer.checkpointing import AtomicCheckpointIO

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DATA = ROOT / "align" / "data" / "assets" / "sort"
# Wall-clock metrics differ between any two runs.
TIMING = ("tokens_per_s", "time/", "_s")

pytestmark = pytest.mark.slow
NEEDS_RAY = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="the asynchronous source needs Ray (pip install 'align[async]')"
)


def first_rows(src: Path, dst: Path, n: int) -> str:
    dst.write_text("".join(open(src).readlines()[:n]))
    return str(dst)


def run(
    algorithm: str,
    root: Path,
    args: list[str],
    *extra: str,
    kill_at: int | None = None,
    kill_in_write: int | None = None,
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(HERE / "_run.py"), algorithm.partition("-")[0]]
    if kill_at is not None:
        cmd += ["--kill-at", str(kill_at)]
    if kill_in_write is not None:
        cmd += ["--kill-in-write", str(kill_in_write)]
    cmd += ["--", "--trainer.default_root_dir", str(root), *args, *extra]
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="2")
    return subprocess.run(cmd, cwd=root.parent, env=env, capture_output=True, text=True, timeout=600)


def rows_of(root: Path, version: int) -> list[dict[str, str]]:
    """Rows of ``version_N/metrics.csv`` without empty cells and wall-clock columns, in file order."""
    rows = list(csv.DictReader(open(root / f"version_{version}" / "metrics.csv")))
    return [{k: v for k, v in row.items() if v != "" and not any(t in k for t in TIMING)} for row in rows]


def metrics_by_step(root: Path, version: int) -> dict[int, dict[str, str]]:
    out: dict[int, dict[str, str]] = {}
    for row in rows_of(root, version):
        out.setdefault(int(row["step"]), {}).update(row)
    return out


def steps_in_order(rows: list[dict[str, str]]) -> list[int]:
    """The step of each row, consecutive repeats (several rows of one step) collapsed."""
    steps = [int(r["step"]) for r in rows]
    return [s for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s]


def common(max_steps: int, every: int) -> list[str]:
    return [
        "--trainer.max_steps",
        str(max_steps),
        "--trainer.limit_val_batches",
        "0",
        "--eval_before_after",
        "false",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.callbacks+=align.trainer.checkpointing.AlignCheckpoint",
        "--trainer.callbacks.every_n_train_steps",
        str(every),
    ]


def settings(algorithm: str, tmp: Path) -> tuple[list[str], int, int]:
    """Recipe arguments, total optimizer steps, checkpoint interval."""
    if algorithm == "sft":  # 40 rows / (4 x 2 accumulated) = 5 optimizer steps per epoch
        data = first_rows(DATA / "sft" / "train.jsonl", tmp / "sft.jsonl", 40)
        return (
            [
                *common(8, 2),
                "--trainer.accumulate_grad_batches",
                "2",
                "--data.init_args.batch_size",
                "4",
                "--data.init_args.train_files",
                data,
            ],
            8,
            2,
        )
    if algorithm == "dpo":  # 24 pairs / 4 = 6 steps per epoch; the reference cache lives in the run directory
        data = first_rows(DATA / "preference" / "train.jsonl", tmp / "pairs.jsonl", 24)
        return (
            [
                *common(8, 2),
                "--trainer.max_epochs",
                "3",
                "--data.init_args.batch_size",
                "4",
                "--data.init_args.train_files",
                data,
                "--data.init_args.val_files",
                "null",
            ],
            8,
            2,
        )
    # grpo: 10 prompts / 4 = 2 rollouts per epoch (last partial batch dropped); sampling at temperature 1. 32 rows of
    # 12 new tokens: the scoring pass's shared-prompt gradient (32 x 11 x 128 values) is past the size at which
    # torch's CPU kernels split work between the 2 threads (align.models.shared_pass.rows_of).
    data = first_rows(DATA / "prompts" / "train.jsonl", tmp / "prompts.jsonl", 10)
    rl = [
        "--data.init_args.batch_size",
        "4",
        "--model.init_args.group_size",
        "8",
        "--model.init_args.sampling.max_new_tokens",
        "12",
        "--model.init_args.sampling.temperature",
        "1.0",
        "--data.init_args.train_files",
        data,
        "--data.init_args.val_files",
        "null",
    ]
    if algorithm == "grpo-async":  # rollouts one step ahead, from a generator process: the batch in flight at a
        # checkpoint is saved with it, and the one in flight at the kill is generated again with the same stream
        return (
            [
                *common(6, 2),
                *rl,
                "--model.init_args.source",
                "align.rollout.async_source.AsyncSource",
                "--model.init_args.source.init_args.max_staleness",
                "1",
            ],
            6,
            2,
        )
    if algorithm == "distill":  # GKD with mixed data: the draw of each step must come out the same after a resume
        return [*common(6, 2), *rl, "--model.init_args.objective", "gkd", "--model.init_args.lmbda", "0.5"], 6, 2
    return [*common(6, 2), *rl], 6, 2


@pytest.mark.parametrize(
    "algorithm, kill",
    [
        ("sft", "step"),
        ("dpo", "write"),
        ("grpo", "step"),
        pytest.param("grpo-async", "step", marks=NEEDS_RAY),
        ("distill", "step"),
    ],
)
def test_sigkill_then_resume_logs_the_same_metrics(tmp_path, algorithm, kill):
    """``kill="step"``: SIGKILL right after a random optimizer step that is not a checkpoint step.
    ``kill="write"``: SIGKILL with half of a random checkpoint file on disk (atomicity: ``last.ckpt`` must still
    be the previous checkpoint, whole)."""
    args, steps, every = settings(algorithm, tmp_path)
    full_root, cut_root = tmp_path / "full", tmp_path / "cut"
    done = run(algorithm, full_root, args)
    assert done.returncode == 0, done.stderr[-3000:]
    # Rows are logged at Lightning's batch count: the asynchronous source's first batch fills its pipeline.
    shift = 1 if algorithm == "grpo-async" else 0
    full = {step - shift: row for step, row in metrics_by_step(full_root, 0).items()}
    assert sorted(full) == list(range(steps)), sorted(full)

    if kill == "step":  # a random step after the first checkpoint that does not write one itself
        kill_at = random.choice([s for s in range(every + 1, steps) if s % every])
        killed = run(algorithm, cut_root, args, kill_at=kill_at)
        restart = (kill_at // every) * every  # the last checkpoint written before the kill
    else:  # each save writes epoch=E-step=S.ckpt and links last.ckpt to it: tear it at a random save after the first
        save = random.randrange(2, steps // every + 1)
        write = save
        killed = run(algorithm, cut_root, args, kill_in_write=write)
        kill_at, restart = save * every, (save - 1) * every
    case = f"{algorithm}: killed at step {kill_at}, resumed from step {restart}"
    assert killed.returncode == -9, (case, killed.returncode, killed.stderr[-3000:])
    ckpt_dir = cut_root / "version_0" / "checkpoints"
    if kill == "write":
        names = sorted(p.name for p in ckpt_dir.iterdir())
        assert any(".tmp." in name for name in names), (case, names)  # the torn file is there, under its temp name
        assert AtomicCheckpointIO().load_checkpoint(ckpt_dir / "last.ckpt")["global_step"] == restart
    killed_rows = rows_of(cut_root, 0) if (cut_root / "version_0" / "metrics.csv").exists() else []

    resumed = run(algorithm, cut_root, args, "--ckpt_path", "last")
    assert resumed.returncode == 0, (case, resumed.stderr[-3000:])
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr
    # The resumed run continues the killed run's folder: no second run folder, its rows appended to metrics.csv.
    assert sorted(p.name for p in cut_root.glob("version_*")) == ["version_0"], case
    rows = rows_of(cut_root, 0)
    assert rows[: len(killed_rows)] == killed_rows, case
    appended = rows[len(killed_rows) :]
    assert steps_in_order(appended) == list(range(restart + shift, steps + shift)), (case, steps_in_order(appended))
    by_step: dict[int, dict[str, str]] = {}
    for row in appended:
        by_step.setdefault(int(row["step"]) - shift, {}).update(row)
    for step in range(restart, steps):
        assert by_step[step] == full[step], f"{case}: step {step} differs"
    # Rows the killed run flushed before it died (the CSV is written in batches) match too, including
    # the steps it trained that the resumed run had to repeat.
    killed_by_step: dict[int, dict[str, str]] = {}
    for row in killed_rows:
        killed_by_step.setdefault(int(row["step"]) - shift, {}).update(row)
    for step, row in killed_by_step.items():
        assert row == full[step], f"{case}: step {step} of the killed run differs"
    names = sorted(p.name for p in ckpt_dir.iterdir())
    assert not any(".tmp." in name for name in names), names  # the next save cleared the torn file
    ckpt = AtomicCheckpointIO().load_checkpoint(ckpt_dir / "last.ckpt")
    assert ckpt["global_step"] == steps
    if algorithm.startswith("grpo"):
        # Rollouts counted once each across the kill, and the KL controller's state (fixed at kl.coef 0.02).
        assert ckpt["align"]["rl"] == {"rollouts": steps, "updates": steps, "kl_controller": {"value": 0.02}}


def test_resume_auto_starts_fresh_then_continues_from_last(tmp_path):
    """``--resume auto``: the same command line launches a run and, once it has a checkpoint, resumes it."""
    from align.cli.recipes import run_recipe
    from align.data.sft import SFTDataModule
    from align.modules.sft import SFTModule

    args, _, _ = settings("sft", tmp_path)
    root = tmp_path / "run"

    def launch(max_steps: int) -> None:
        run_recipe(
            "sft",
            SFTModule,
            SFTDataModule,
            args=[
                *args,
                "--trainer.max_steps",
                str(max_steps),
                "--resume",
                "auto",
                "--trainer.default_root_dir",
                str(root),
            ],
        )

    launch(2)  # nothing to resume yet: a fresh run
    assert sorted(metrics_by_step(root, 0)) == [0, 1]
    launch(4)
    # The same run, continued in its own folder: one version, its checkpoint and its metrics carried on.
    assert sorted(p.name for p in root.glob("version_*")) == ["version_0"]
    last = AtomicCheckpointIO().load_checkpoint(root / "version_0" / "checkpoints" / "last.ckpt")
    assert last["global_step"] == 4
    assert steps_in_order(rows_of(root, 0)) == [0, 1, 2, 3]  # the second launch trained only the new steps

"""One folder per run (align.cli.runs): ``<root>/version_N/`` with config, metrics and checkpoints, ``--resume
auto``, the held-out "before" of a continued run, a checkpoint path inside a run folder, the latest run and the run
logger, DDP ranks agreeing on one folder, and the CSV logger's pinned version."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger

from align.cli.runs import RunLogger, latest_run, run_of_checkpoint

from ._commands import QUIET, before_after, global_step, held_out, sft, val_rows

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------ run folders
def test_two_runs_in_one_root_each_keep_their_own_folder_and_last_checkpoint(tmp_path, capsys):
    root = tmp_path / "runs"
    sft(root, "--trainer.max_steps", "1", "--eval_before_after", "false")
    sft(root, "--trainer.max_steps", "2", "--eval_before_after", "false")
    out = capsys.readouterr().out
    assert sorted(p.name for p in root.iterdir()) == ["version_0", "version_1"]  # no shared <root>/checkpoints
    for version, steps in ((0, 1), (1, 2)):
        run = root / f"version_{version}"
        assert {"config.yaml", "metrics.csv", "checkpoints", "curves.png"} <= {p.name for p in run.iterdir()}
        assert global_step(run / "checkpoints" / "last.ckpt") == steps
        assert not list((run / "checkpoints").glob("last-v*.ckpt"))
    # The end of fit names the folder and the checkpoint to export.
    assert f"run directory: {root / 'version_1'}" in out
    assert f"curves: {root / 'version_1' / 'curves.png'}" in out
    assert f"last checkpoint: {root / 'version_1' / 'checkpoints' / 'last.ckpt'}" in out


def test_resume_auto_continues_the_latest_run_in_its_folder_with_the_true_before(tmp_path, capsys):
    root = tmp_path / "runs"
    sft(root, "--trainer.max_steps", "2", "--resume", "auto")
    first = capsys.readouterr().out
    assert f"resume: no earlier run with a checkpoint under {root}; starting version_0" in first
    sft(root, "--trainer.max_steps", "4", "--resume", "auto")
    second = capsys.readouterr().out
    assert f"resume: continuing {root / 'version_0'} from {root / 'version_0' / 'checkpoints' / 'last.ckpt'}" in second
    assert sorted(p.name for p in root.iterdir()) == ["version_0"]
    assert global_step(root / "version_0" / "checkpoints" / "last.ckpt") == 4
    # "before" is the untrained model's loss, kept in the checkpoint, not the loss of the weights it resumed from.
    assert before_after(second)[0] == before_after(first)[0]
    assert before_after(second)[1] < before_after(first)[1]
    # One metrics file for the whole run: the first launch's rows stay, the second's are appended.
    steps = [int(r["step"]) for r in val_rows(root / "version_0")]
    assert steps == [0, 2, 4], steps


def test_ckpt_path_inside_a_run_folder_continues_that_run_and_another_roots_starts_a_new_one(tmp_path, capsys):
    root = tmp_path / "runs"
    sft(root, "--trainer.max_steps", "1", "--eval_before_after", "false")
    sft(root, "--trainer.max_steps", "1", "--eval_before_after", "false")
    sft(
        root,
        "--trainer.max_steps",
        "2",
        "--eval_before_after",
        "false",
        "--ckpt_path",
        str(root / "version_0" / "checkpoints" / "last.ckpt"),
    )
    assert sorted(p.name for p in root.iterdir()) == ["version_0", "version_1"]
    assert global_step(root / "version_0" / "checkpoints" / "last.ckpt") == 2
    assert global_step(root / "version_1" / "checkpoints" / "last.ckpt") == 1
    # A checkpoint from elsewhere starts a new run of this root from those weights.
    other = tmp_path / "other"
    sft(
        other,
        "--trainer.max_steps",
        "3",
        "--eval_before_after",
        "false",
        "--ckpt_path",
        str(root / "version_1" / "checkpoints" / "last.ckpt"),
    )
    assert global_step(other / "version_0" / "checkpoints" / "last.ckpt") == 3


def test_a_resumed_run_whose_checkpoint_has_no_before_says_it_was_resumed(tmp_path, capsys):
    root = tmp_path / "runs"
    sft(root, "--trainer.max_steps", "1", "--eval_before_after", "false")
    capsys.readouterr()
    sft(root, "--trainer.max_steps", "2", "--resume", "auto")
    line = held_out(capsys.readouterr().out)
    assert "->" not in line and "(resumed from" in line, line


def test_a_run_without_validation_data_still_names_its_folder_and_checkpoint(tmp_path, capsys):
    root = tmp_path / "runs"
    sft(root, "--trainer.max_steps", "1", "--data.init_args.val_files", "null")
    out = capsys.readouterr().out
    assert "held-out" not in out
    assert f"run directory: {root / 'version_0'}" in out and "last checkpoint:" in out


def test_a_save_writes_one_full_checkpoint_and_last_ckpt_is_the_same_file(tmp_path):
    """The default checkpoint callback keeps the step's checkpoint and ``last.ckpt``: one file on disk (a hard
    link), and a run continued from it keeps writing ``last.ckpt`` (no ``last-v1.ckpt``)."""
    root = tmp_path / "runs"
    sft(root, "--trainer.max_steps", "2", "--eval_before_after", "false")
    folder = root / "version_0" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert os.path.samefile(folder / "epoch=0-step=2.ckpt", folder / "last.ckpt")
    sft(root, "--trainer.max_steps", "4", "--eval_before_after", "false", "--resume", "auto")
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert os.path.samefile(folder / "epoch=0-step=4.ckpt", folder / "last.ckpt")
    assert global_step(folder / "last.ckpt") == 4


# ------------------------------------------------------------------------------------------------ pieces
def test_latest_run_skips_folders_without_a_checkpoint(tmp_path):
    assert latest_run(tmp_path / "missing") is None
    for version, files in ((0, ["last.ckpt"]), (1, ["epoch=0-step=3.ckpt"]), (2, []), (10, [])):
        (tmp_path / f"version_{version}" / "checkpoints").mkdir(parents=True)
        for name in files:
            (tmp_path / f"version_{version}" / "checkpoints" / name).write_bytes(b"x")
    (tmp_path / "version_x").mkdir()
    run = latest_run(tmp_path)
    assert (run.version, run.checkpoint.name) == (1, "epoch=0-step=3.ckpt")  # version_10 and 2 have none yet
    assert run_of_checkpoint(tmp_path, tmp_path / "version_0" / "checkpoints" / "last.ckpt") == 0
    assert run_of_checkpoint(tmp_path / "elsewhere", tmp_path / "version_0" / "checkpoints" / "last.ckpt") is None
    assert run_of_checkpoint(tmp_path, tmp_path / "model.ckpt") is None


def test_run_logger_appends_to_a_continued_runs_metrics(tmp_path):
    first = RunLogger(str(tmp_path))
    first.log_metrics({"train/loss": 1.0}, step=0)
    first.save()
    assert first.version == 0
    continued = RunLogger(str(tmp_path), version=0, append=True)
    continued.log_metrics({"train/loss": 0.5, "val/loss": 0.7}, step=1)  # a new column rewrites the header
    continued.save()
    rows = list(csv.DictReader(open(tmp_path / "version_0" / "metrics.csv")))
    assert [(r["step"], r["train/loss"], r["val/loss"]) for r in rows] == [("0", "1.0", ""), ("1", "0.5", "0.7")]
    assert RunLogger(str(tmp_path)).version == 1  # a new run does not touch it


@pytest.mark.slow
def test_ddp_ranks_agree_on_one_run_folder_and_resume_it(tmp_path):
    """``--trainer.devices 2`` re-runs the recipe for rank 1: both ranks must use rank 0's version_N, fresh or
    resumed, and no stray folder appears."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")

    def launch(*args: str) -> str:
        proc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "recipes" / "sft.py"),
                "--trainer.accelerator",
                "cpu",
                "--trainer.devices",
                "2",
                "--trainer.strategy",
                "ddp",
                "--trainer.default_root_dir",
                str(tmp_path),
                "--eval_before_after",
                "false",
                *QUIET,
                *args,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    (tmp_path / "version_0").mkdir()  # an earlier run: rank 0 starts version_1, and rank 1 must not pick version_2
    (tmp_path / "version_0" / "metrics.csv").write_text("step\n")
    launch("--trainer.max_steps", "1")
    out = launch("--trainer.max_steps", "2", "--resume", "auto")
    assert "resume: continuing" in out
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("version_")) == ["version_0", "version_1"]
    assert global_step(tmp_path / "version_1" / "checkpoints" / "last.ckpt") == 2
    assert f"run directory: {tmp_path / 'version_1'}" in out  # the resumed run reports the folder it continued
    assert out.count("curves: ") == 1 and (tmp_path / "version_1" / "curves.png").is_file()  # rank 0 draws it


def test_a_csv_loggers_version_can_be_pinned(private_api, tmp_path):
    # Every rank writes into rank 0's version_N: RunRecord.setup broadcasts it into the logger.
    logger = CSVLogger(tmp_path)
    assert private_api.require(logger, "_version", used_by="align.cli.runs.RunRecord.setup") is None
    logger._version = 7
    assert logger.version == 7 and logger.log_dir.endswith("version_7")

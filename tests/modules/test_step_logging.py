"""Per-step metrics are computed and logged only on the steps something reads them
(``AlignModule.logs_this_step``): the rows the loggers write are the same as when every step is logged."""

import csv
import os
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from _helpers import cpu_trainer, write_varied_pairs
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from align.data.preference import PreferenceDataModule
from align.models import PolicyModel
from align.modules.base import AlignModule
from align.modules.dpo import DPOModule

TIMING = {"train/pairs_per_s"}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_varied_pairs(tmp_path_factory.mktemp("data") / "pairs.jsonl")


def run(pairs, root, *, every_step=False, log_every=2, max_steps=5, **trainer_kwargs):
    """Fit DPO for ``max_steps`` with a CSV logger; returns (train rows without timing columns, steps logged)."""
    L.seed_everything(0)
    module = DPOModule(PolicyModel(), optimizer=partial(torch.optim.AdamW, lr=1e-3))
    logged_steps = []
    original = module.log_step

    def counting(metrics, prog_bar=()):
        logged_steps.append(module.trainer.global_step)
        original(metrics, prog_bar)

    module.log_step = counting
    if every_step:
        module.logs_this_step = lambda: True
    trainer = cpu_trainer(
        max_steps=max_steps,
        logger=CSVLogger(root, name="csv"),
        log_every_n_steps=log_every,
        limit_val_batches=0,
        **trainer_kwargs,
    )
    trainer.fit(module, PreferenceDataModule(train_files=pairs, val_files=None, batch_size=2, max_length=64))
    path = Path(trainer.logger.log_dir) / "metrics.csv"
    with open(path) if path.exists() else open(os.devnull) as f:  # nothing written when no step is a logging step
        rows = [{k: v for k, v in r.items() if v != "" and k not in TIMING} for r in csv.DictReader(f)]
    return [r for r in rows if "train/loss" in r], logged_steps, trainer


def test_written_rows_are_those_of_logging_every_step(pairs, tmp_path):
    every, every_steps, _ = run(pairs, tmp_path / "a", every_step=True)
    gated, gated_steps, trainer = run(pairs, tmp_path / "b")
    assert every_steps == [0, 1, 2, 3, 4]
    assert gated_steps == [1, 3, 4]  # the loggers' steps (every 2nd), and the run's last step
    assert [r["step"] for r in gated] == ["1", "3", "4"] and gated == every  # the last step's row is written too
    # The final values reach callback_metrics although step 4 is not a logging step.
    assert {"train/loss", "dpo/accuracy", "train/pairs_per_s"} <= set(trainer.callback_metrics)


@pytest.mark.parametrize("reader", ["progress_bar", "monitor"])
def test_a_progress_bar_or_a_monitor_reads_every_step(pairs, tmp_path, reader):
    extra = (
        dict(enable_progress_bar=True)
        if reader == "progress_bar"
        else dict(
            enable_checkpointing=True,
            callbacks=[ModelCheckpoint(tmp_path / "ckpt", monitor="train/loss", every_n_train_steps=1)],
        )
    )
    _, steps, _ = run(pairs, tmp_path, max_steps=3, log_every=50, **extra)
    assert steps == [0, 1, 2]


@pytest.mark.parametrize("drawn", [True, False])
def test_align_progress_bar_reads_every_step_only_when_drawn(pairs, tmp_path, drawn, monkeypatch):
    """Outside a terminal (or in CI) the bar switches itself off and costs no per-step logging; drawn, it shows
    the step's values under short names (DPO: loss and acc) and counts optimizer steps against max_steps."""
    from align.trainer.progress import AlignProgressBar

    monkeypatch.setenv("CI", "true")
    bar = AlignProgressBar(force=drawn)
    assert bar.is_enabled is drawn
    _, steps, trainer = run(pairs, tmp_path, max_steps=3, log_every=50, callbacks=[bar], enable_progress_bar=True)
    assert trainer.progress_bar_callback is bar
    assert steps == ([0, 1, 2] if drawn else [2])  # switched off: the run's last step only
    if drawn:
        assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (3, 3)
        assert set(bar.get_metrics(trainer, trainer.lightning_module)) == {"loss", "acc"}


def test_without_a_trainer_nothing_is_logged():
    assert AlignModule(torch.nn.Linear(1, 1)).logs_this_step() is False


SHORT_RUN_ROWS = {
    "sft": [{"prompt": f"sort: {a} {b}", "completion": f"{min(a, b)} {max(a, b)}"} for a, b in zip("dbca", "acdb")],
    "dpo": [
        {"prompt": f"sort: {a} {b}", "chosen": f"{min(a, b)} {max(a, b)}", "rejected": f"{max(a, b)} {min(a, b)}"}
        for a, b in zip("dbca", "acdb")
    ],
    "kto": [{"prompt": f"sort: {a} {b}", "completion": f"{a} {b}", "label": a < b} for a, b in zip("dbca", "acdb")],
}


@pytest.mark.parametrize("recipe", ["sft", "dpo", "kto"])
def test_a_run_shorter_than_log_every_n_steps_writes_its_last_steps_row(tmp_path, recipe):
    """A 3-step run at the default log_every_n_steps (10) still writes a training row: its last step's."""
    import json

    from align.cli.recipes import run_recipe
    from align.data.preference import UnpairedDataModule
    from align.data.sft import SFTDataModule
    from align.modules.kto import KTOModule
    from align.modules.sft import SFTModule

    classes = {
        "sft": (SFTModule, SFTDataModule),
        "dpo": (DPOModule, PreferenceDataModule),
        "kto": (KTOModule, UnpairedDataModule),
    }
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in SHORT_RUN_ROWS[recipe]))
    cli = run_recipe(
        recipe,
        *classes[recipe],
        args=[
            "--trainer.max_steps",
            "3",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--data.init_args.train_files",
            str(data),
            "--data.init_args.val_files",
            "null",
            "--data.init_args.batch_size",
            "2",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_checkpointing",
            "false",
            *(["--model.init_args.precompute_reference", "false"] if recipe == "dpo" else []),
        ],
    )
    rows = list(csv.DictReader(open(tmp_path / "run" / "version_0" / "metrics.csv")))
    assert cli.trainer.global_step == (2 if recipe == "dpo" else 3)  # DPO: one epoch of two batches
    assert [r["step"] for r in rows if r.get("train/loss")] == [str(cli.trainer.global_step - 1)]

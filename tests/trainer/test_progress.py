"""The progress bar and the phase lines of a run (``align.trainer.progress``): its short names and numbers, when it is
drawn, and that a drawn bar reads every step's values while one switched off costs no per-step logging."""

import csv
import os
import re
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from align.data.preference import PreferenceDataModule
from align.models import PolicyModel
from align.modules.dpo import DPOModule
from align.trainer.progress import AlignProgressBar, format_value, interactive, phase, short_name
from tests.modules._helpers import cpu_trainer, write_varied_pairs

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


@pytest.mark.parametrize("drawn", [True, False])
def test_align_progress_bar_reads_every_step_only_when_drawn(pairs, tmp_path, drawn, monkeypatch):
    """Outside a terminal (or in CI) the bar switches itself off and costs no per-step logging; drawn, it shows
    the step's values under short names (DPO: loss and acc) and counts optimizer steps against max_steps."""
    monkeypatch.setenv("CI", "true")
    bar = AlignProgressBar(force=drawn)
    assert bar.is_enabled is drawn
    _, steps, trainer = run(pairs, tmp_path, max_steps=3, log_every=50, callbacks=[bar], enable_progress_bar=True)
    assert trainer.progress_bar_callback is bar
    assert steps == ([0, 1, 2] if drawn else [2])  # switched off: the run's last step only
    if drawn:
        assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (3, 3)
        assert set(bar.get_metrics(trainer, trainer.lightning_module)) == {"loss", "acc"}


def test_progress_names_and_numbers():
    assert [
        short_name(m)
        for m in (
            "rollout/reward_mean",
            "train/kl",
            "rollout/tokens_per_s",
            "dpo/accuracy",
            "val/dpo_accuracy",
            "val/reward_mean",
        )
    ] == ["reward", "kl", "tok/s", "acc", "val_acc", "val_reward"]
    assert [format_value(v) for v in (0.123456, 1234.5, 0.0001234, 0.0, 12.3456, float("nan"))] == [
        "0.1235",
        "1234",
        "0.000123",
        "0",
        "12.35",
        "nan",
    ]


def test_the_bar_is_drawn_only_in_a_terminal_outside_ci(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    monkeypatch.delenv("CI", raising=False)
    assert interactive(Tty()) and not interactive(object())
    monkeypatch.setenv("CI", "true")
    assert not interactive(Tty())
    assert AlignProgressBar().is_disabled and AlignProgressBar(force=True).is_enabled


def test_a_phase_says_what_it_waits_for_and_how_long_it_took(capsys):
    with phase("reference log-probs"):
        print("working", flush=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["reference log-probs ...", "working"]
    assert re.fullmatch(r"reference log-probs: done in \d+\.\d s", lines[2]) and len(lines) == 3

"""The progress bar and the phase lines of a run (``align.trainer.progress``): its short names and numbers, when it is
drawn, and that a drawn bar reads every step's values while one switched off costs no per-step logging."""

import re

import pytest

from align.trainer.progress import AlignProgressBar, format_value, interactive, phase, short_name
from tests.modules._helpers import fit_dpo, write_varied_pairs


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_varied_pairs(tmp_path_factory.mktemp("data") / "pairs.jsonl")


@pytest.mark.parametrize("drawn", [True, False])
def test_align_progress_bar_reads_every_step_only_when_drawn(pairs, tmp_path, drawn, monkeypatch):
    """Outside a terminal (or in CI) the bar switches itself off and costs no per-step logging; drawn, it shows
    the step's values under short names (DPO: loss and acc) and counts optimizer steps against max_steps."""
    monkeypatch.setenv("CI", "true")
    bar = AlignProgressBar(force=drawn)
    assert bar.is_enabled is drawn
    _, steps, trainer = fit_dpo(pairs, tmp_path, max_steps=3, log_every=50, callbacks=[bar], enable_progress_bar=True)
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

"""The progress bar's names and numbers and when it is drawn (align.trainer.progress: its tests are still here, in
the command line's folder)."""

from pathlib import Path

from align.trainer.progress import AlignProgressBar, format_value, interactive, short_name

ROOT = Path(__file__).resolve().parents[2]


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

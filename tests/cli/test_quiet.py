"""Known library noise filtered at its source (align.cli.quiet): known messages dropped and others kept, a warning on
one line naming its module, ALIGN_LOG_LEVEL=INFO keeping the libraries' own output, and a run printing what matters
without device lines, the model table or install paths."""

import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from align.cli.quiet import one_line_warning, parameter_count, quiet_known_noise, verbose, where_raised

ROOT = Path(__file__).resolve().parents[2]


def test_known_noise_is_filtered_and_other_messages_pass(caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_noise(progress_bars=True)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use something else", stacklevel=2)
        warnings.warn(
            "Using ModelCheckpoint with manual optimization and every_n_train_steps, but no ...", stacklevel=2
        )
        warnings.warn("a warning a user can act on", stacklevel=2)
    assert [str(w.message) for w in caught] == ["a warning a user can act on"]
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        rank_zero.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing litlogger")
        rank_zero.info("GPU available: False, used: False")
        rank_zero.info("TPU available: False, using: 0 TPU cores")
        rank_zero.info("GPU available: True (cuda), used: True")
    # A device the machine lacks is noise on every run; one that is there says what the run uses.
    assert [r.getMessage() for r in caplog.records] == ["GPU available: True (cuda), used: True"]


def test_a_warning_is_one_line_naming_the_module_not_its_install_path(monkeypatch):
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # put back afterwards
    quiet_known_noise(progress_bars=True)
    line = warnings.formatwarning("the dataloader has few workers", UserWarning, logging.__file__, 12, "source")
    assert line == "UserWarning: the dataloader has few workers (logging:12)\n"
    assert warnings.formatwarning("x", UserWarning, "/my/reward.py", 3) == "UserWarning: x (/my/reward.py:3)\n"


def test_align_log_level_info_keeps_the_libraries_own_output(monkeypatch):
    def library_format(*args, **kwargs):
        return "the library's format"

    monkeypatch.setattr(warnings, "formatwarning", library_format)
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    monkeypatch.setenv("ALIGN_LOG_LEVEL", "INFO")
    before = list(warnings.filters)
    quiet_known_noise(progress_bars=True)
    assert warnings.formatwarning is library_format and warnings.filters == before


@pytest.mark.slow  # the console of `python -m align fit` itself: a fresh interpreter
def test_a_run_prints_what_matters_and_no_device_lines_model_table_or_install_paths(tmp_path):
    sort = ROOT / "align" / "data" / "assets" / "sort" / "sft"
    for name, rows in (("train", 64), ("validation", 16)):
        (tmp_path / f"{name}.jsonl").write_text("".join((sort / f"{name}.jsonl").read_text().splitlines(True)[:rows]))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "align",
            "fit",
            "--config",
            "align:sft/tiny.yaml",
            "--trainer.max_steps",
            "2",
            "--data.train_files",
            str(tmp_path / "train.jsonl"),
            "--data.val_files",
            str(tmp_path / "validation.jsonl"),
            "--trainer.default_root_dir",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    for noise in ("GPU available: False", "TPU available: False", "Total FLOPs", "┃", "site-packages", "INFO:"):
        assert noise not in out, (noise, out)
    lines = out.splitlines()
    assert "parameters: 853 K trainable, 853 K in all" in lines
    assert f"run directory: {tmp_path / 'runs' / 'version_0'}" in lines
    assert any(line.startswith("held-out val/loss: ") and " -> " in line for line in lines), out
    assert lines.count("Seed set to 0") == 1  # Lightning's own lines print once


def test_a_warning_names_the_module_it_came_from_not_its_path(monkeypatch):
    import align.cli.quiet as quiet_module

    assert where_raised(quiet_module.__file__, 12) == "align.cli.quiet:12"
    assert where_raised("/nowhere/script.py", 3) == "/nowhere/script.py:3"  # not an imported module
    line = one_line_warning("old API", DeprecationWarning, quiet_module.__file__, 7)
    assert line == "DeprecationWarning: old API (align.cli.quiet:7)\n"
    for level, loud in (("INFO", True), ("debug", True), ("WARNING", False)):
        monkeypatch.setenv("ALIGN_LOG_LEVEL", level)
        assert verbose() is loud


def test_the_parameter_line_counts_trainable_and_frozen_weights():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(10, 100), torch.nn.Linear(100, 10))  # 1,100 + 1,010 weights
    model[1].requires_grad_(False)
    assert parameter_count(model) == "parameters: 1.1 K trainable, 2.1 K in all"

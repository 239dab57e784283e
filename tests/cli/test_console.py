"""What the command line prints: one-line config errors with the nearest accepted keys, the recipes' --help, and
known library noise filtered at its source (the progress bar's names and numbers: tests/trainer/test_progress.py)."""

import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from align.cli.config_errors import nearest, one_line
from align.cli.quiet import quiet_known_noise
from align.cli.recipes import run_recipe
from align.data import SFTDataModule
from align.modules import SFTModule

ROOT = Path(__file__).resolve().parents[2]


def recipe_error(capsys, *args) -> list[str]:
    with pytest.raises(SystemExit) as info:
        run_recipe("sft", SFTModule, SFTDataModule, args=[*args, "--trainer.max_steps", "0"])
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--trainer.max_steps", "ten"], "error: --trainer.max_steps: expected int, got 'ten'"),
        (["--trainer.max_stepz", "4"], "error: --trainer.max_stepz: no such setting; did you mean trainer.max_steps"),
        (["--model.optimizer.lrr", "1"], "error: --model.optimizer.lrr: AdamW has no setting 'lrr'; did you mean lr?"),
        (["--model.optimizer.lr", "abc"], "error: --model.optimizer.lr: expected float or Tensor, got 'abc'"),
        (
            ["--model.max_lenght", "5"],
            "error: --model.max_lenght: SFTModule has no setting 'max_lenght'; accepted: policy, optimizer, scheduler",
        ),
        (["--data.batch_size", "x"], "error: --data.batch_size: expected int, got 'x'"),
    ],
)
def test_a_bad_setting_is_one_line(capsys, args, expected):
    lines = recipe_error(capsys, *args)
    assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_an_unknown_key_in_a_yaml_file_is_one_line_with_the_nearest_keys(capsys, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "trainer:\n  max_stepz: 3\nmodel:\n  init_args:\n    optimizer:\n      init_args:\n        lr: 1\n"
    )
    assert recipe_error(capsys, "--config", str(config)) == [
        "error: --trainer.max_stepz: no such setting; did you mean trainer.max_steps or trainer.max_time or "
        "trainer.min_steps?"
    ]


def test_one_line_of_messages_it_does_not_know_keeps_their_words():
    assert one_line("something\n   went   wrong") == "something went wrong"
    assert nearest("trainer.max_stepz", ["trainer.max_steps", "model.lr", "trainer.devices"]) == ["trainer.max_steps"]
    assert nearest("zzz", ["trainer.max_steps"]) == []


def test_recipe_help_lists_the_model_and_data_settings_with_defaults(capsys):
    run_recipe("sft", SFTModule, SFTDataModule, args=["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: ")
    for setting in (
        "--model.policy",
        "--model.optimizer",
        "--data.train_files",
        "--data.max_length",
        "--data.batch_size",
    ):
        assert setting in out, setting
    assert "default:" in out and "--model.optimizer.lr 1e-4" in out and "fit --help" in out


def test_gym_recipe_help_shows_its_default_module_and_no_data(capsys):
    from align.gym import ClassicRLModule

    run_recipe("gym", ClassicRLModule, None, args=["--help"], default_config="ppo-cartpole.yaml", layered=False)
    out = capsys.readouterr().out
    assert (
        "Runs PPOGymModule (fit)" in out
        and "align:gym/ppo-cartpole.yaml" in out
        and "align:gym/dqn-cartpole.yaml" in out
    )
    for setting in ("--model.updates.epochs", "--model.env.id", "--model.env.num_envs", "--model.total_steps"):
        assert setting in out, setting
    assert "--data." not in out and "it replaces the default" in out


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

"""Argument rewriting (align.cli.arguments): shipped configs named by their ``align:`` path and run by name, the
one-line errors of an unknown shipped config, and a nested setting set to null on the command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from align.cli.arguments import CONFIG_DIR, check_yaml_file, resolve_config_args
from align.cli.main import main
from align.cli.recipes import run_recipe
from align.data.prompts import PromptDataModule
from align.errors import AlignConfigError

from ._commands import QUIET, global_step, sft

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_configs_are_named_by_align_prefix():
    path = str(CONFIG_DIR / "grpo" / "tiny.yaml")
    assert resolve_config_args(["fit", "--config", "align:grpo/tiny.yaml", "--model.x", "align:y"]) == [
        "fit",
        "--config",
        path,
        "--model.x",
        "align:y",
    ]
    assert resolve_config_args(["--config=align:grpo/tiny.yaml"]) == [f"--config={path}"]
    with pytest.raises(AlignConfigError, match=r"--config: 'align:grpo/nope.yaml' is not a shipped config"):
        resolve_config_args(["--config", "align:grpo/nope.yaml"])
    # The checkout's configs/ is the same folder as the package's: one copy.
    assert (ROOT / "configs").resolve() == CONFIG_DIR.resolve()


def test_align_fit_runs_a_shipped_config_by_name(tmp_path, capsys):
    main(
        [
            "fit",
            "--config",
            "align:sft/tiny.yaml",
            "--trainer.max_steps",
            "1",
            "--eval_before_after",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
            *QUIET,
        ]
    )
    assert global_step(tmp_path / "version_0" / "checkpoints" / "last.ckpt") == 1


def test_unknown_shipped_config_and_checkpointing_conflict_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "align:sft/nope.yaml"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --config: 'align:sft/nope.yaml'") and "\n" not in err
    with pytest.raises(SystemExit) as info:
        sft(
            tmp_path,
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.callbacks+=align.trainer.checkpointing.AlignCheckpoint",
        )
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: trainer.enable_checkpointing: false, but trainer.callbacks holds AlignCheckpoint")
    assert not any("Traceback" in line for line in err)


def test_a_nested_setting_set_to_null_on_the_command_line_becomes_a_one_field_block():
    assert resolve_config_args(
        [
            "fit",
            "--model.kl.estimator",
            "null",
            "--model.init_args.scores.clip=null",
            "--model.policy.init_args.lora",
            "null",
            "--model.group_size",
            "null",
            "--trainer.max_steps",
            "null",
            "--model.kl.coef",
            "0",
        ]
    ) == [
        "fit",
        "--model.kl",
        '{"estimator": null}',
        "--model.init_args.scores",
        '{"clip": null}',
        "--model.policy",
        '{"lora": null}',
        "--model.group_size",
        "null",
        "--trainer.max_steps",
        "null",
        "--model.kl.coef",
        "0",
    ]


def test_null_reaches_a_nested_field_and_leaves_its_neighbours(capsys):
    from align.modules.ppo import PPOModule

    with pytest.raises(SystemExit):
        run_recipe(
            "ppo",
            PPOModule,
            PromptDataModule,
            args=[
                "fit",
                "--model.evaluation.accuracy_reward",
                "null",
                "--model.scores.missing_eos_penalty",
                "null",
                "--print_config",
            ],
        )
    printed = capsys.readouterr().out
    assert "accuracy_reward: null" in printed and "missing_eos_penalty: null" in printed
    assert "accuracy_threshold: 1.0" in printed and "whiten: true" in printed  # the shipped config's neighbours


def test_a_tensorboard_logger_on_the_command_line_is_placed_in_the_run_folder():
    tb = "lightning.pytorch.loggers.TensorBoardLogger"
    assert resolve_config_args(["--trainer.logger+=" + tb]) == [
        "--trainer.logger+=" + tb,
        "--trainer.logger.save_dir=align:run",
    ]
    assert resolve_config_args(["--trainer.logger", tb, "--x", "1"]) == [
        "--trainer.logger",
        tb,
        "--trainer.logger.save_dir=align:run",
        "--x",
        "1",
    ]
    csv_logger = ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger"]
    assert resolve_config_args(csv_logger) == csv_logger  # only TensorBoard's


def test_nulls_outside_a_nested_model_or_data_block_pass_unchanged():
    assert resolve_config_args(["--model.kl.init_args.estimator=null"]) == ["--model.kl", '{"estimator": null}']
    for args in (["--trainer.max_steps", "null"], ["--model.lr=null"], ["--data.x.y-z=null"]):
        assert resolve_config_args(args) == args


def test_a_config_file_that_is_not_yaml_is_named_with_its_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  lr: [1, 2\n")
    with pytest.raises(AlignConfigError, match=rf"^--config: '{bad}', line \d+, column \d+: not valid YAML: "):
        resolve_config_args(["fit", "--config", str(bad)])
    good = tmp_path / "good.yaml"
    good.write_text("model:\n  lr: 1\n")
    assert resolve_config_args([f"--config={good}"]) == [f"--config={good}"]
    check_yaml_file("{model: {lr: 1}}")  # YAML given inline, no file: left to jsonargparse

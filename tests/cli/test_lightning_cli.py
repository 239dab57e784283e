"""AlignCLI (align.cli.lightning_cli): its subcommands, print_config, what a fit writes into its run folder (CSV,
curves, TensorBoard, checkpoint, export), TensorBoard loggers placed in the run folder, the held-out passes before
and after fit, runs that fail before their first step or midway, the accuracy's stand-in, and the private Lightning
names it relies on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from align.cli.arguments import resolve_config_args
from align.cli.lightning_cli import AlignCLI
from align.cli.main import main
from align.cli.recipes import run_recipe
from align.data import SFTDataModule
from align.data.prompts import PromptDataModule
from align.modules import SFTModule
from align.modules.grpo import GRPOModule

from ._commands import QUIET, before_after, fails, printed_config, read_metrics, sft, val_rows

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["test", "predict"])
def test_test_and_predict_are_not_subcommands(capsys, name):
    assert set(AlignCLI.subcommands()) == {"fit", "validate"}
    assert "use 'align evaluate'" in fails(capsys, name, "--config", "align:grpo/tiny.yaml")


def test_print_config_round_trips(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = printed_config(
        capsys, "sft", SFTModule, SFTDataModule, "--model.init_args.policy.init_args.dtype", "bfloat16"
    )
    assert "dtype: bfloat16" in first and "class_path: align.modules.SFTModule" in first
    saved = tmp_path / "printed.yaml"
    saved.write_text(first)
    assert printed_config(capsys, "sft", SFTModule, SFTDataModule, "--config", str(saved)) == first


def test_align_fit_writes_csv_curves_tensorboard_checkpoint_and_export_loads(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path / "run"
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "sft" / "tiny.yaml"),
            "--trainer.max_steps",
            "6",
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.default_root_dir",
            str(root),
            "--trainer.logger+=lightning.pytorch.loggers.TensorBoardLogger",
        ]
    )
    out = capsys.readouterr().out
    assert "held-out val/loss:" in out
    rows = read_metrics(root)
    assert any(r["train/loss"] for r in rows) and any(r["val/loss"] for r in rows)
    # The picture of the run, drawn from the complete CSV (the final validation included), in the run folder.
    curves = root / "version_0" / "curves.png"
    assert f"curves: {curves}" in out.splitlines()
    assert curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # TensorBoard's event files sit in the run folder too, next to metrics.csv.
    assert list((root / "version_0").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in root.iterdir()) == ["version_0"]
    ckpt = next(root.rglob("*.ckpt"))
    main(["export", "--ckpt_path", str(ckpt), "--output_dir", str(tmp_path / "hf")])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "sort: c b a"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert model.generate(**prompt, max_new_tokens=4, do_sample=False).shape[1] > prompt["input_ids"].shape[1]


def tensorboard_loggers(cli):
    from lightning.pytorch.loggers import TensorBoardLogger

    return [lg for lg in cli.trainer.loggers if isinstance(lg, TensorBoardLogger)]


def test_tensorboard_logger_without_save_dir_writes_into_the_run_folder(tmp_path):

    (tmp_path / "version_0").mkdir()  # an earlier run: this one is version_1
    args = ["--config", str(ROOT / "configs" / "sft" / "tiny.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    for form in (
        ["--trainer.logger+=lightning.pytorch.loggers.TensorBoardLogger"],
        ["--trainer.logger+", "TensorBoardLogger", "--trainer.logger.name", "ignored"],
    ):
        cli = AlignCLI(args=resolve_config_args([*args, *form]), run=False)
        (tb,) = tensorboard_loggers(cli)
        assert cli.trainer.loggers[0].log_dir == tb.log_dir == str(tmp_path / "version_1")


def test_tensorboard_logger_in_yaml_with_or_without_a_save_dir_of_its_own(tmp_path):
    config = yaml.safe_load((ROOT / "configs" / "sft" / "tiny.yaml").read_text())
    tb = "lightning.pytorch.loggers.TensorBoardLogger"
    config["trainer"]["logger"] = [
        {"class_path": tb, "init_args": {"save_dir": "align:run"}},
        {"class_path": tb, "init_args": {"save_dir": str(tmp_path / "tb")}},
    ]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    cli = AlignCLI(
        args=["--config", str(tmp_path / "c.yaml"), "--trainer.default_root_dir", str(tmp_path / "r")], run=False
    )
    in_run, own = tensorboard_loggers(cli)
    assert in_run.log_dir == str(tmp_path / "r" / "version_0")
    assert own.log_dir == str(tmp_path / "tb" / "lightning_logs" / "version_0")  # Lightning's own layout


def test_missing_tensorboard_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    for name in ("tensorboard", "tensorboardX"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    with pytest.raises(SystemExit) as info:
        main(
            [
                "fit",
                "--config",
                str(ROOT / "configs" / "sft" / "tiny.yaml"),
                "--trainer.default_root_dir",
                str(tmp_path),
                "--trainer.logger+=lightning.pytorch.loggers.TensorBoardLogger",
            ]
        )
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "pip install 'align[tensorboard]'" in err[0], err
    assert not list(tmp_path.iterdir())


def test_a_failure_to_draw_the_curves_is_one_warning_not_a_failed_run(tmp_path, monkeypatch, caplog):
    from types import SimpleNamespace

    import align.cli.plots as plots

    logger = CSVLogger(tmp_path, name="", version=0)
    logger.log_metrics({"train/loss": 1.0}, step=0)  # buffered, not yet on disk
    cli = object.__new__(AlignCLI)
    cli.trainer = SimpleNamespace(loggers=[logger])
    assert cli._write_curves() == str(tmp_path / "version_0" / "curves.png")  # the buffered row was flushed
    monkeypatch.setattr(plots, "plot_runs", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no font\nmore")))
    assert cli._write_curves() is None
    (record,) = [r for r in caplog.records if "curves" in r.getMessage()]
    assert record.levelname == "WARNING" and record.getMessage() == "curves: not written: RuntimeError: no font"


USED_BY = "align.cli.lightning_cli.AlignCLI"


def test_cli_hooks_exist_and_lightning_still_calls_them(private_api):
    private_api.require(LightningCLI, "_instantiate_trainer", ("self", "config", "callbacks"), used_by=USED_BY)
    private_api.require(LightningCLI, "_run_subcommand", ("self", "subcommand"), used_by=USED_BY)
    private_api.require(LightningCLI, "_prepare_subcommand_kwargs", ("self", "subcommand"), used_by=USED_BY)
    private_api.called_by(LightningCLI.instantiate_trainer, "_instantiate_trainer", used_by=USED_BY)
    private_api.called_by(LightningCLI.__init__, "_run_subcommand", used_by=USED_BY)
    private_api.called_by(LightningCLI._run_subcommand, "_prepare_subcommand_kwargs", used_by=USED_BY)


def test_a_tensorboard_loggers_folder_can_be_set(private_api, tmp_path):
    # A TensorBoardLogger with save_dir "align:run" is moved into the run folder by
    # align.cli.lightning_cli._into_run_folder.
    logger = TensorBoardLogger(save_dir="align:run")
    for name in ("_root_dir", "_name", "_version"):
        private_api.require(logger, name, used_by="align.cli.lightning_cli._into_run_folder")
    logger._root_dir, logger._name, logger._version = str(tmp_path), "", 3
    assert logger.log_dir == str(tmp_path / "version_3") and logger.save_dir == str(tmp_path)


def test_the_final_validation_is_not_repeated_after_fit(tmp_path, capsys):
    """A validation that ran after the last step already measured the final weights: its numbers are printed."""
    root = tmp_path / "runs"
    sft(root, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2")
    after = before_after(capsys.readouterr().out)[1]
    rows = val_rows(root / "version_0")
    assert len(rows) == 2, rows  # before fit, and the one in training; none after
    assert float(rows[-1]["val/loss"]) == pytest.approx(after, abs=5e-5)


def test_validate_prints_the_held_out_metrics_and_makes_no_run_folder(tmp_path, capsys):
    root = tmp_path / "runs"
    for _ in range(2):
        run_recipe("sft", SFTModule, SFTDataModule, args=["validate", *QUIET, "--trainer.default_root_dir", str(root)])
    out = capsys.readouterr().out
    assert not root.exists() or not list(root.iterdir())
    assert "Validate metric" not in out and "DataLoader 0" not in out  # Lightning's table
    lines = [line for line in out.splitlines() if line.startswith(("held-out", "weights:"))]
    assert [line.split(":")[0] for line in lines] == ["held-out val/loss", "held-out val/ppl", "weights"] * 2
    assert lines[-1] == "weights: the config's model (no --ckpt_path)"


def test_a_run_that_fails_before_its_first_step_leaves_no_folder_holding_only_its_config(tmp_path, monkeypatch):
    (tmp_path / "boom_reward.py").write_text("def exact(completions, **kw):\n    raise RuntimeError('boom')\n")
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "runs"
    with pytest.raises(SystemExit):
        run_recipe(
            "grpo",
            GRPOModule,
            PromptDataModule,
            args=[
                *QUIET,
                "--trainer.default_root_dir",
                str(root),
                "--trainer.max_steps",
                "1",
                "--data.init_args.val_files",
                "null",
                "--data.init_args.batch_size",
                "2",
                "--model.init_args.group_size",
                "2",
                "--model.init_args.sampling.max_new_tokens",
                "4",
                "--model.init_args.rewards",
                '[{"fn": "boom_reward.exact"}]',
            ],
        )
    assert not list(root.glob("version_*"))
    # A folder with anything else in it is kept, and a continued run's folder is never removed.
    from align.cli.lightning_cli import _remove_if_empty

    (root / "version_3").mkdir(parents=True)
    for name in ("config.yaml", "notes.txt"):
        (root / "version_3" / name).write_text("x")
    _remove_if_empty(str(root / "version_3"), its_setup_files=True)
    (root / "version_4").mkdir()
    (root / "version_4" / "config.yaml").write_text("x")
    _remove_if_empty(str(root / "version_4"), its_setup_files=False)
    assert sorted(p.name for p in root.iterdir()) == ["version_3", "version_4"]
    _remove_if_empty(str(root / "version_4"), its_setup_files=True)
    assert sorted(p.name for p in root.iterdir()) == ["version_3"]


def test_a_run_that_fails_before_writing_leaves_no_folder(tmp_path):
    """Bad data stops the run before anything is written: no empty ``version_0`` is left, so the next run is
    ``version_0``."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "sort: b a"}\n')
    root = tmp_path / "runs"
    with pytest.raises(SystemExit):
        main(
            [
                "fit",
                "--model",
                "SFTModule",
                "--data",
                "SFTDataModule",
                "--data.train_files",
                str(bad),
                "--trainer.default_root_dir",
                str(root),
                "--trainer.max_steps",
                "1",
            ]
        )
    assert not root.exists() or list(root.iterdir()) == []


def test_a_run_that_fails_midway_still_draws_its_curves(tmp_path, monkeypatch):
    """The picture of a failed run shows what it logged up to the failure (Lightning flushes the CSV first)."""
    original = SFTModule.training_step

    def failing(self, batch, batch_idx):
        if self.trainer.global_step == 2:
            raise RuntimeError("boom")
        return original(self, batch, batch_idx)

    monkeypatch.setattr(SFTModule, "training_step", failing)
    with pytest.raises(RuntimeError, match="boom"):
        sft(tmp_path, "--trainer.max_steps", "4", "--eval_before_after", "false")
    assert (tmp_path / "version_0" / "curves.png").is_file()


def test_an_accuracy_no_held_out_completion_could_reach_gives_its_place_to_the_rewards_mean(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "half_reward.py").write_text("def half(completions, **kw):\n    return [0.5 for c in completions]\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "sort: b a"}\n{"prompt": "sort: c a"}\n')
    monkeypatch.chdir(tmp_path)
    run_recipe(
        "grpo",
        GRPOModule,
        PromptDataModule,
        args=[
            *QUIET,
            "--trainer.default_root_dir",
            str(tmp_path / "runs"),
            "--trainer.max_steps",
            "1",
            "--data.init_args.train_files",
            "p.jsonl",
            "--data.init_args.val_files",
            "p.jsonl",
            "--data.init_args.batch_size",
            "2",
            "--model.init_args.group_size",
            "2",
            "--model.init_args.sampling.max_new_tokens",
            "4",
            "--model.init_args.rewards",
            '[{"fn": "half_reward.half"}]',
            "--model.init_args.eval_rewards",
            "[]",
        ],
    )
    out = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(out) if line.startswith("held-out val/"))
    assert out[first : first + 4] == [
        "held-out val/reward_mean: 0.5000 -> 0.5000",
        "held-out val/accuracy: 0.0000 -> 0.0000",
        "held-out val/reward/half: 0.5000 -> 0.5000",
        "  val/accuracy is 0 by construction: no held-out completion reached half >= 1 (highest 0.5000; "
        "model.evaluation.accuracy_threshold sets it); read val/reward/half, the reward's mean, instead",
    ]

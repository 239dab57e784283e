"""The private Lightning names the CLI (``align.cli.lightning_cli``) and run folders (``align.cli.runs``) rely on."""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

USED_BY = "align.cli.lightning_cli.AlignCLI"


def test_cli_hooks_exist_and_lightning_still_calls_them(private_api):
    private_api.require(LightningCLI, "_instantiate_trainer", ("self", "config", "callbacks"), used_by=USED_BY)
    private_api.require(LightningCLI, "_run_subcommand", ("self", "subcommand"), used_by=USED_BY)
    private_api.require(LightningCLI, "_prepare_subcommand_kwargs", ("self", "subcommand"), used_by=USED_BY)
    private_api.called_by(LightningCLI.instantiate_trainer, "_instantiate_trainer", used_by=USED_BY)
    private_api.called_by(LightningCLI.__init__, "_run_subcommand", used_by=USED_BY)
    private_api.called_by(LightningCLI._run_subcommand, "_prepare_subcommand_kwargs", used_by=USED_BY)


def test_a_csv_loggers_version_can_be_pinned(private_api, tmp_path):
    # Every rank writes into rank 0's version_N: RunRecord.setup broadcasts it into the logger.
    logger = CSVLogger(tmp_path)
    assert private_api.require(logger, "_version", used_by="align.cli.runs.RunRecord.setup") is None
    logger._version = 7
    assert logger.version == 7 and logger.log_dir.endswith("version_7")


def test_a_tensorboard_loggers_folder_can_be_set(private_api, tmp_path):
    # A TensorBoardLogger with save_dir "align:run" is moved into the run folder by
    # align.cli.lightning_cli._into_run_folder.
    logger = TensorBoardLogger(save_dir="align:run")
    for name in ("_root_dir", "_name", "_version"):
        private_api.require(logger, name, used_by="align.cli.lightning_cli._into_run_folder")
    logger._root_dir, logger._name, logger._version = str(tmp_path), "", 3
    assert logger.log_dir == str(tmp_path / "version_3") and logger.save_dir == str(tmp_path)

"""The private Lightning names the CLI (``align.cli``) and run folders (``align.runs``) rely on."""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger

USED_BY = "align.cli.AlignCLI"


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
    assert private_api.require(logger, "_version", used_by="align.runs.RunRecord.setup") is None
    logger._version = 7
    assert logger.version == 7 and logger.log_dir.endswith("version_7")

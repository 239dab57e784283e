"""One folder per run: ``<default_root_dir>/version_N/`` holds the run's ``config.yaml``, ``metrics.csv``,
``hparams.yaml`` and ``checkpoints/``.

Two runs in one root never share a checkpoint directory, so ``last.ckpt`` is always the newest state of the run
whose folder it is in. Continuing a run (``--resume auto``, ``--ckpt_path last`` or a ``--ckpt_path`` inside a
run folder) writes into the same ``version_N``: its metrics are appended to the same ``metrics.csv`` and its
checkpoints go to the same ``checkpoints/``.

The version is Lightning's CSVLogger's: the next free ``version_N`` as rank 0 sees it, broadcast to the other
ranks when the trainer is set up (:class:`RunRecord`), so every process of a DDP run agrees on one folder.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

VERSION_DIR = re.compile(r"^version_(\d+)$")
CHECKPOINTS = "checkpoints"
LAST = "last.ckpt"


@dataclass(frozen=True)
class Run:
    """A run folder that holds a checkpoint to continue from."""

    version: int
    directory: Path
    checkpoint: Path


def run_dir(root: str | os.PathLike, version: int) -> Path:
    return Path(root) / f"version_{version}"


def checkpoint_dir(root: str | os.PathLike, version: int) -> Path:
    return run_dir(root, version) / CHECKPOINTS


def versions(root: str | os.PathLike) -> list[int]:
    """The ``version_N`` numbers under ``root``, ascending."""
    if not Path(root).is_dir():
        return []
    return sorted(int(m.group(1)) for p in Path(root).iterdir() if p.is_dir() and (m := VERSION_DIR.match(p.name)))


def next_version(root: str | os.PathLike) -> int:
    found = versions(root)
    return found[-1] + 1 if found else 0


def latest_run(root: str | os.PathLike) -> Run | None:
    """The newest run under ``root`` that has a checkpoint to continue from (its ``last.ckpt``, or else its newest
    checkpoint); ``None`` when there is none. A newer folder without a checkpoint (a run killed before its first
    save) is skipped: the run to continue is the newest one with a state to continue from."""
    for version in reversed(versions(root)):
        directory = checkpoint_dir(root, version)
        last = directory / LAST
        if last.exists():
            return Run(version, run_dir(root, version), last)
        found = [p for p in directory.glob("*.ckpt")] if directory.is_dir() else []
        if found:
            return Run(version, run_dir(root, version), max(found, key=lambda p: p.stat().st_mtime))
    return None


def run_of_checkpoint(root: str | os.PathLike, ckpt_path: str | os.PathLike) -> int | None:
    """The version whose ``checkpoints/`` folder holds ``ckpt_path`` when that folder is under ``root``."""
    path = Path(ckpt_path).resolve()
    for parent in path.parents:
        if parent.name == CHECKPOINTS and (m := VERSION_DIR.match(parent.parent.name)):
            if parent.parent.parent == Path(root).resolve():
                return int(m.group(1))
            return None
    return None


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing ``metrics.csv`` is continued, not deleted: its columns are
    kept (a new column rewrites the header over the old rows, as Lightning does within one run)."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                header = next(csv.reader(f), [])
            self.metrics_keys = sorted(set(self.metrics_keys) | set(header))


class RunLogger(CSVLogger):
    """The run's CSV logger: ``<save_dir>/version_N/metrics.csv``. With ``append``, a continued run adds its rows
    to the folder's existing ``metrics.csv`` (rows a killed run logged after its last checkpoint stay, and the
    continued run logs those steps again)."""

    def __init__(self, save_dir: str, version: int | None = None, append: bool = False, **kwargs: Any):
        super().__init__(save_dir=save_dir, name="", version=version, **kwargs)
        self._append = append

    @property
    def experiment(self):
        if self._experiment is None and self._append:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
            return self._experiment
        return super().experiment


class RunRecord(Callback):
    """What a run knows about itself across a resume, saved in every checkpoint: the held-out headline metrics
    measured before its first update (so a continued run prints the true "before", not its starting weights'
    number). Also makes every rank agree on the run's ``version_N`` (rank 0's), and remembers the metrics of the
    last in-training validation so the command line need not repeat a validation of the final weights."""

    def __init__(self) -> None:
        self.before: dict[str, float] | None = None
        self.last_validation: tuple[int, dict[str, float]] | None = None  # (global step, metrics)
        # Set by the command line around its own validations: the line to print once one has data to run on.
        self.announce: str | None = None
        self.announced = False

    @property
    def state_key(self) -> str:
        return "AlignRun"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                logger._version = trainer.strategy.broadcast(logger.version)

    def state_dict(self) -> dict[str, Any]:
        return {"before": dict(self.before) if self.before is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("before") is not None:
            self.before = dict(state_dict["before"])

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.announce and trainer.state.fn == "validate" and trainer.is_global_zero:
            print(f"{self.announce} ...", flush=True)
            self.announced = True

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return  # the command line's own before/after validations are not in-training ones
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
        self.last_validation = (trainer.global_step, metrics)


__all__ = [
    "Run",
    "RunLogger",
    "RunRecord",
    "checkpoint_dir",
    "latest_run",
    "next_version",
    "run_dir",
    "run_of_checkpoint",
    "versions",
]

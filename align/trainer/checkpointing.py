"""Checkpoints that survive a kill, and runs that resume exactly where they stopped.

* :class:`AtomicCheckpointIO` writes every checkpoint to a temporary file in the target's directory, flushes
  and fsyncs it, then ``os.replace``\\ s it over the target and fsyncs the directory. A kill at any moment
  leaves either the previous file or the new one, never a torn one. (Lightning's own ``_atomic_save`` writes
  the temporary file under ``/tmp`` and moves it, which is a copy, not a rename, across filesystems.) It loads
  with ``torch.load(weights_only=True)`` unless told otherwise: no code runs while a checkpoint loads.
* :class:`AlignCheckpoint` is Lightning's ``ModelCheckpoint`` with the defaults a long run needs: a ``last``
  checkpoint, step-based frequency and top-k retention; ``last.ckpt`` is a hard link to the step's checkpoint,
  so a save writes one full copy. Under the command line it writes to the run's own
  ``<default_root_dir>/version_N/checkpoints`` (``align.cli.runs``), where ``--resume auto`` finds it.
* :class:`ExactResume` (attached by every :class:`~align.modules.base.AlignModule`) saves the RNG states
  (python, numpy, torch and CUDA, per rank) with each checkpoint and restores them just before the first
  training step after a resume; rollout sampling draws from torch's generator, so it continues the same
  stream. It also restores the training dataloader's position within the epoch when Lightning could not
  (a ``trainer.estimated_stepping_batches`` call in ``configure_optimizers`` builds the loader before the
  checkpoint's loop state is read: Lightning issue #20550).

Model, optimizer, scheduler, loop counters (global step, epoch, batch index) and the dataloader state are
Lightning's own checkpoint content; modules add theirs in ``on_save_checkpoint`` (RL counters, the KL
controller).
"""

from __future__ import annotations

import glob
import logging
import os
import pickle
import random
from pathlib import Path
from typing import Any, Literal, cast

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from align.errors import AlignConfigError

log = logging.getLogger(__name__)

Resume = Literal["never", "auto"]


# ---------------------------------------------------------------------------------------------- atomic writes
def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems (and Windows) do not open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: _PATH, write) -> Path:
    """Call ``write(file)`` on a temporary file beside ``path``, fsync it, and rename it to ``path``.

    Temporary files left by an earlier writer that was killed (``.<name>.tmp.<pid>``) are removed first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in glob.glob(str(path.parent / f".{glob.escape(path.name)}.tmp.*")):
        try:
            os.remove(stale)
        except OSError:
            pass
    tmp = path.parent / f".{path.name}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file, fsync, rename (see the module docstring); ``weights_only`` loading."""

    def __init__(self, weights_only: bool = True):
        """``weights_only``: load checkpoints without unpickling code objects (a file that needs them is refused
        with a message; set false only for checkpoints from a source you trust)."""
        super().__init__()
        self.weights_only = weights_only

    def _write(self, checkpoint: dict[str, Any], f) -> None:
        torch.save(checkpoint, f)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options, got {storage_options}")
        if "://" in str(path) and not str(path).startswith("file://"):
            return super().save_checkpoint(checkpoint, path, storage_options)  # remote: Lightning's fsspec path
        atomic_write(str(path).removeprefix("file://"), lambda f: self._write(checkpoint, f))

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not os.path.exists(path) and "://" not in str(path):
            raise AlignConfigError(f"ckpt_path: checkpoint '{path}' does not exist")
        weights_only = self.weights_only if weights_only is None else weights_only
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except pickle.UnpicklingError as err:
            if not weights_only:
                raise
            raise AlignConfigError(
                f"ckpt_path: '{path}' holds Python objects that only a full unpickle can restore, and loading it "
                f"would run code from the file ({str(err).splitlines()[0]}). If you trust its source, load it with "
                "AtomicCheckpointIO(weights_only=False)"
            ) from None


def install_atomic_io(trainer: L.Trainer) -> None:
    """Give the trainer's strategy an :class:`AtomicCheckpointIO` when it uses Lightning's default file IO
    (strategies with their own writers, such as DeepSpeed's, are left alone)."""
    strategy = trainer.strategy
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()


# ---------------------------------------------------------------------------------------------- checkpoints
class AlignCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint``, written atomically (:class:`AtomicCheckpointIO`), with defaults for runs
    that must survive pre-emption: a ``last.ckpt`` on every save, in the run's folder where a new process finds it.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str | None = None,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        save_last: bool = True,
        save_top_k: int = 1,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        save_on_train_epoch_end: bool | None = None,
    ):
        """
        Args:
            dirpath: Checkpoint directory; null: the run's ``<default_root_dir>/version_N/checkpoints``.
            filename: Name pattern, e.g. ``"{epoch}-{step}"``; null: Lightning's ``epoch=E-step=S``.
            every_n_train_steps: Save every N optimizer steps; null: at the end of every epoch.
            every_n_epochs: Save every N epochs (with ``every_n_train_steps`` null).
            save_last: Also keep ``last.ckpt``, the newest state, which ``--ckpt_path last`` resumes from.
            save_top_k: How many checkpoints to keep (by ``monitor`` when set, else the newest); -1 keeps all.
            monitor: Metric that ranks checkpoints for ``save_top_k``; null ranks by recency.
            mode: ``min`` or ``max`` of ``monitor`` is best.
            save_on_train_epoch_end: Save at the end of the training epoch rather than after validation.
        """
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor=monitor,
            save_last=save_last,
            save_top_k=save_top_k,
            mode=mode,
            every_n_train_steps=every_n_train_steps,
            every_n_epochs=every_n_epochs,
            save_on_train_epoch_end=save_on_train_epoch_end,
        )

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        install_atomic_io(trainer)
        super().setup(trainer, pl_module, stage)

    def _save_topk_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, Any]) -> None:
        # The step's file becomes last.ckpt too (a hard link): it must already name last.ckpt as the last path, or a
        # run continued from it would write last-v1.ckpt beside last.ckpt. The same name Lightning then picks.
        if self.save_last and self.save_top_k != 0:
            path = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
            version = self.STARTING_VERSION
            while self._enable_version_counter and self.file_exists(path, trainer) and path != self.last_model_path:
                path = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST, ver=version)
                version += 1
            self.last_model_path = path
        super()._save_topk_checkpoint(trainer, monitor_candidates)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        """One full write per save: the second file of a save (``last.ckpt`` beside the step's own checkpoint, the
        same state) is a hard link to the first, so a save costs the disk one copy, and removing either name later
        leaves the other whole. Where no link can be made (a checkpoint folder of a sharded strategy, a remote or
        link-less filesystem) it is written in full, as Lightning does."""
        twin = self._last_checkpoint_saved if self._last_global_step_saved == trainer.global_step else ""
        linked = False
        if twin and twin != filepath:
            linked = bool(trainer.strategy.broadcast(_hard_link(twin, filepath) if trainer.is_global_zero else False))
        if not linked:
            return super()._save_checkpoint(trainer, filepath)
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)


def _hard_link(source: str, target: str) -> bool:
    """Make ``target`` a hard link to the file ``source``, replacing ``target`` atomically; False where it cannot."""
    if "://" in source or "://" in target or not os.path.isfile(source):
        return False
    tmp = Path(target).parent / f".{Path(target).name}.tmp.{os.getpid()}"
    try:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            tmp.unlink()
        os.link(source, tmp)
        os.replace(tmp, target)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        return False
    _fsync_dir(Path(target).parent)
    return True


# ---------------------------------------------------------------------------------------------- RNG states
def rng_state() -> dict[str, Any]:
    """The RNG states of this process, as tensors and primitives only (loadable with ``weights_only``)."""
    # The legacy tuple of the global MT19937 state (numpy's stubs give the call without arguments the dict form).
    kind, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` on one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------------------- exact resume
class ExactResume(Callback):
    """Saves the RNG states of every rank with each checkpoint and restores them, and the dataloader position,
    right before the first training step after a resume (see the module docstring)."""

    def __init__(self) -> None:
        self._pending_rng: list[dict[str, Any]] | None = None

    @property
    def state_key(self) -> str:
        return "ExactResume"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        install_atomic_io(trainer)

    def state_dict(self) -> dict[str, Any]:
        # Called on every rank while a checkpoint is assembled; rank 0 writes the file.
        return {"rng": gather_objects(rng_state())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_rng = state_dict.get("rng")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_loader_position(trainer)
        if self._pending_rng:
            states, rank = self._pending_rng, trainer.global_rank
            if len(states) != trainer.world_size:
                log.warning(
                    "checkpoint holds RNG states of %d ranks, this run has %d: every rank continues from "
                    "rank 0's state, so sampling differs from the uninterrupted run",
                    len(states),
                    trainer.world_size,
                )
                rank = 0
            set_rng_state(states[rank])
            self._pending_rng = None

    @staticmethod
    def _restore_loader_position(trainer: L.Trainer) -> None:
        fit_loop = trainer.fit_loop
        pending = getattr(fit_loop, "_combined_loader_states_to_load", None)
        loader = getattr(fit_loop, "_combined_loader", None)
        fetcher = getattr(fit_loop, "_data_fetcher", None)
        if not pending or loader is None or fetcher is None:
            return
        # The loader was built (and its iterator started) before the checkpoint's loop state was read.
        loader._load_state_dicts(pending)
        fit_loop._combined_loader_states_to_load = []
        iter(fetcher)


__all__ = [
    "AlignCheckpoint",
    "AtomicCheckpointIO",
    "ExactResume",
    "Resume",
    "atomic_write",
    "install_atomic_io",
    "rng_state",
    "set_rng_state",
]

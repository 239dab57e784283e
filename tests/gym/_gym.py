"""Helpers shared by the classic-RL tests (importable because tests/gym/conftest.py puts this folder on sys.path)."""

import lightning as L


def cpu_trainer(**kwargs) -> L.Trainer:
    """A quiet single-process CPU trainer: no logger, checkpoints, progress bar or sanity check."""
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return L.Trainer(**{**defaults, **kwargs})

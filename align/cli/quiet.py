"""Known noise from the libraries under align, filtered where it is raised, so that what a command prints is what
the user can act on.

Each entry names the text it drops and why it is noise for an align user. Warnings that a user can act on are
left alone; so are Lightning's device lines (``GPU available: ...``), which say what the run uses.
"""

from __future__ import annotations

import logging
import os
import warnings

# (warning message regex, why it is dropped)
WARNINGS = (
    (r".*isinstance\(treespec, LeafSpec\)` is deprecated",
     "Lightning calls a deprecated torch API internally; nothing a user can change"),
    (r"Using ModelCheckpoint with manual optimization and every_n_train_steps",
     "align's RL modules step manually and checkpoint after the update on purpose: the checkpoint of step N holds "
     "the weights after N updates, which is what resuming needs"),
    (r"Found \d+ module\(s\) in eval mode",
     "frozen reference, reward and critic-initialising copies are kept in eval mode on purpose"),
    (r"The progress bar already tracks a metric with the name",
     "align's progress bar shows no version number, so nothing is overwritten"),
    (r"`is_gradient_checkpointing` is deprecated",
     "peft reads transformers' old attribute name when it wraps a model; nothing a user can change"),
)

# (logger name, message prefix, why it is dropped)
LOG_LINES = (
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip:", "an advertisement for a hosted logging service"),
    ("lightning.pytorch.utilities.rank_zero", "Loading `train_dataloader` to estimate number of stepping batches",
     "internal bookkeeping of Lightning"),
    ("DeepSpeed", "Setting accelerator to CPU",
     "DeepSpeed's notice on import on a machine without a GPU; align uses DeepSpeed only with a ZeRO strategy"),
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community",
     "bitsandbytes' notice on import that the optional `kernels` package is absent; its built-in CPU path runs "
     "instead, and only QLoRA uses it"),
)


class _DropPrefixes(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        return not message.startswith(self.prefixes)


def quiet_known_noise(progress_bars: bool | None = None) -> None:
    """Install the filters (idempotent). ``progress_bars``: whether transformers may draw its own loading bars
    (``Loading weights``); by default only in a terminal outside CI, like the run's progress bar."""
    for pattern, _ in WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    by_logger: dict[str, list[str]] = {}
    for name, prefix, _ in LOG_LINES:
        by_logger.setdefault(name, []).append(prefix)
    for name, prefixes in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefixes) for f in logger.filters):
            logger.addFilter(_DropPrefixes(tuple(prefixes)))
    if progress_bars is None:
        from align.trainer.progress import interactive

        progress_bars = interactive()
    if not progress_bars:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:
            pass

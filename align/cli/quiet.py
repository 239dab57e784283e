"""Known noise from the libraries under align, filtered where it is raised, so that what a command prints is what
the user can act on.

Each entry names the text it drops and why it is noise for an align user. Warnings that a user can act on are
kept, on one line that names the module that raised them instead of the file it is installed in. Lightning's
device lines are dropped for the devices a machine lacks (``GPU available: False``, ``TPU available: False``);
a line that names a device present (``GPU available: True (cuda), used: True``) stays. Lightning's model table
is off by default (``enable_model_summary``, :data:`align.cli.lightning_cli.TRAINER_DEFAULTS`); a run prints a
one-line parameter count instead.

``ALIGN_LOG_LEVEL=INFO`` (or ``DEBUG``) turns all of this off: every line and warning the libraries print comes back,
in their own format; ``--trainer.enable_model_summary true`` brings back Lightning's table.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# (warning message regex, why it is dropped)
WARNINGS = (
    (
        r".*isinstance\(treespec, LeafSpec\)` is deprecated",
        "Lightning calls a deprecated torch API internally; nothing a user can change",
    ),
    (
        r"Using ModelCheckpoint with manual optimization and every_n_train_steps",
        "align's RL modules step manually and checkpoint after the update on purpose: the checkpoint of step N holds "
        "the weights after N updates, which is what resuming needs",
    ),
    (
        r"Found \d+ module\(s\) in eval mode",
        "frozen reference, reward and critic-initialising copies are kept in eval mode on purpose",
    ),
    (
        r"The progress bar already tracks a metric with the name",
        "align's progress bar shows no version number, so nothing is overwritten",
    ),
    (
        r"It is recommended to use `self.log\('(val|test)/.*sync_dist=True\)` when logging on epoch level",
        "align sums held-out metrics over ranks itself before logging them (RLModule.on_validation_epoch_end); an "
        "in-process vLLM engine also sets up a one-process group that makes Lightning say this on one process",
    ),
    (
        r"`torch.distributed.reduce_op` is deprecated",
        "vLLM's import touches a deprecated torch attribute; nothing a user can change",
    ),
    (
        r"`is_gradient_checkpointing` is deprecated",
        "peft reads transformers' old attribute name when it wraps a model; nothing a user can change",
    ),
)

# (logger name, message prefix, why it is dropped)
LOG_LINES = (
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip:", "an advertisement for a hosted logging service"),
    (
        "lightning.pytorch.utilities.rank_zero",
        "Loading `train_dataloader` to estimate number of stepping batches",
        "internal bookkeeping of Lightning",
    ),
    ("lightning.pytorch.utilities.rank_zero", "GPU available: False", "a device the machine lacks, on every run"),
    ("lightning.pytorch.utilities.rank_zero", "TPU available: False", "a device the machine lacks, on every run"),
    ("lightning.pytorch.utilities.rank_zero", "HPU available: False", "a device the machine lacks, on every run"),
    (
        "DeepSpeed",
        "Setting accelerator to CPU",
        "DeepSpeed's notice on import on a machine without a GPU; align uses DeepSpeed only with a ZeRO strategy",
    ),
    (
        "bitsandbytes.backends.cpu.ops",
        "Failed to load CPU gemm_4bit_forward from kernels-community",
        "bitsandbytes' notice on import that the optional `kernels` package is absent; its built-in CPU path runs "
        "instead, and only QLoRA uses it",
    ),
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


def verbose() -> bool:
    """Whether the user asked for the libraries' own output (``ALIGN_LOG_LEVEL`` INFO or DEBUG)."""
    return os.environ.get("ALIGN_LOG_LEVEL", "WARNING").upper() in ("INFO", "DEBUG", "NOTSET")


def where_raised(filename: str, lineno: int) -> str:
    """``module:line`` for a warning raised in an imported module (no install path), else ``file:line``."""
    for name, module in list(sys.modules.items()):
        if getattr(module, "__file__", None) == filename:
            return f"{name}:{lineno}"
    return f"{filename}:{lineno}"


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A warning as ``<Category>: <message> (<module>:<line>)``: Python's own format starts with the file's install
    path and adds the line of source that raised it."""
    return f"{category.__name__}: {message} ({where_raised(filename, lineno)})\n"


def quiet_known_noise(progress_bars: bool | None = None) -> None:
    """Install the filters (idempotent; nothing under :func:`verbose`). ``progress_bars``: whether transformers may
    draw its own loading bars (``Loading weights``); by default only in a terminal outside CI, like the run's
    progress bar."""
    if verbose():
        return
    warnings.formatwarning = one_line_warning
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


def parameter_count(model) -> str:
    """``parameters: 853 K trainable, 1.7 M in all``: the line that stands for Lightning's model table (frozen
    copies, such as a reference model, count in all). DeepSpeed ZeRO-3's placeholders count at their full size."""
    from lightning.pytorch.utilities.model_summary import get_human_readable_count

    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    trainable = sum(n for n, grad in sizes if grad)
    return (
        f"parameters: {get_human_readable_count(trainable).strip()} trainable, "
        f"{get_human_readable_count(sum(n for n, _ in sizes)).strip()} in all"
    )

"""What every ``align`` data module shares: its tokenizer, its chat encoder, and how it picks validation data.

Validation data (docs/data.md, "Validation data"): ``val_files: auto`` (the default) takes the bundled task's
own validation file when the training files are that task's bundled training files, and otherwise holds out a
seeded ``val_size`` slice of the training rows; ``val_files`` named explicitly are used as given, and
``val_files: null`` (or ``val_size: 0``) runs without validation. A run never evaluates on another task's data.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import lightning as L
from lightning.fabric.utilities.data import AttributeDict
from torch.utils.data import DataLoader, Dataset

from align.data.chat import ChatEncoder
from align.data.formats import notice
from align.data.io import BUNDLED_PREFIX
from align.data.sampling import (
    EpochRandomSampler,
    EpochSequentialSampler,
    ResumableBatchSampler,
    ResumableDataLoader,
    WindowBatchSampler,
)
from align.errors import AlignConfigError, AlignDataError

AUTO = "auto"
"""``val_files`` default: the bundled task's validation file, or a held-out slice of the user's training rows."""


def file_list(files: str | Sequence[str] | None) -> list[str]:
    return [] if files is None else [files] if isinstance(files, str) else list(files)


def bundled_validation(train_files: Sequence[str]) -> list[str] | None:
    """``align:<task>/<kind>/validation.jsonl`` for each bundled training file; None when any file is the user's."""
    suffix = "/train.jsonl"
    if not train_files or not all(f.startswith(BUNDLED_PREFIX) and f.endswith(suffix) for f in train_files):
        return None
    return [f[: -len(suffix)] + "/validation.jsonl" for f in train_files]


def check_setting(ok: bool, key: str, expected: str, got) -> None:
    """A data module's setting ``data.<key>`` that is not ``expected``: one line naming it and what was given."""
    if not ok:
        raise AlignConfigError(f"data.{key}: expected {expected}, got {got!r}")


def _integer(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_val_size(val_size: int | float) -> None:
    check_setting(
        not isinstance(val_size, bool)
        and ((isinstance(val_size, int) and val_size >= 0) or (isinstance(val_size, float) and 0 <= val_size < 1)),
        "val_size",
        "a row count >= 0 or a fraction between 0 and 1",
        val_size,
    )


def check_loader_settings(hp: dict) -> None:
    """The settings every data module shares (the ones it takes of ``batch_size``, ``val_batch_size``,
    ``num_workers``, ``max_length``, ``max_prompt_length``, ``val_size``), checked when it is built."""
    if "batch_size" in hp:
        check_setting(_integer(hp["batch_size"], 1), "batch_size", "an integer >= 1", hp["batch_size"])
    if hp.get("val_batch_size") is not None:
        check_setting(
            _integer(hp["val_batch_size"], 1),
            "val_batch_size",
            "an integer >= 1 or null (batch_size)",
            hp["val_batch_size"],
        )
    if "num_workers" in hp:
        check_setting(_integer(hp["num_workers"], 0), "num_workers", "an integer >= 0", hp["num_workers"])
    if "max_length" in hp:
        check_setting(_integer(hp["max_length"], 2), "max_length", "an integer >= 2 (tokens)", hp["max_length"])
    if hp.get("max_prompt_length") is not None:
        longest = hp.get("max_length")
        check_setting(
            _integer(hp["max_prompt_length"], 1) and (longest is None or hp["max_prompt_length"] < longest),
            "max_prompt_length",
            "an integer >= 1 (tokens) or null" + (f", below max_length={longest}" if longest is not None else ""),
            hp["max_prompt_length"],
        )
    if "val_size" in hp:
        check_val_size(hp["val_size"])


MIN_HELD_OUT = 8
"""A fraction ``val_size`` holds out at least this many rows (at most a fifth of the data): 5% of a small file is
one or two rows, whose held-out numbers move in steps of a half or a whole."""


def held_out_count(val_size: int | float, rows: int) -> int:
    """Rows ``val_size`` holds out of ``rows``: a count, or a fraction, raised to :data:`MIN_HELD_OUT` rows but not
    past a fifth of ``rows`` (and at least one row)."""
    if isinstance(val_size, int):
        return val_size
    return max(1, round(val_size * rows), min(MIN_HELD_OUT, rows // 5))


def held_out_line(count: int, rows: int, files: str, val_size: int | float, seed: int) -> str:
    """The one line that says what was held out, how the count came about, and when it is too few to trust."""
    how = f"data.val_size {val_size}"
    if isinstance(val_size, float) and count > max(1, round(val_size * rows)):
        how += f", raised to {count} rows (at least {MIN_HELD_OUT}, at most a fifth of the data)"
    line = f"validation: {count} of {rows} rows held out of {files} ({how}, data.seed {seed})"
    if count < MIN_HELD_OUT:
        line += (
            f"; {count} row{'s' if count > 1 else ''} make a noisy held-out number: give data.val_files or a "
            "larger data.val_size for a steadier one"
        )
    return line


def hold_out(items: list, count: int, seed: int) -> tuple[list, list]:
    """``(kept, held)``: ``count`` items chosen by a seeded shuffle, both in their original order."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    held = set(order[len(items) - count :])
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


class TokenizerDataModule(L.LightningDataModule):
    """A data module whose tokenizer is ``hparams.tokenizer`` when set, else the module's policy tokenizer.

    Subclasses call ``save_hyperparameters()`` with ``tokenizer`` and ``use_chat_template`` among their
    arguments. ``set_tokenizer`` supplies one directly (outside a trainer, or in tests).

    Subclasses have ``train_files``, ``val_files``, ``val_size``, ``seed``, ``split`` and ``val_split`` settings
    and implement :meth:`load_examples` and :meth:`make_dataset`; :meth:`setup` does the rest.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer: Any = None  # a Hugging Face tokenizer, from set_tokenizer, the settings or the policy
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self._val_chosen = False

    @property
    def hparams(self) -> AttributeDict:
        """The settings ``save_hyperparameters`` stored: Lightning types them as any ``MutableMapping``, but it
        stores a subclass's keyword arguments (a dict) as an ``AttributeDict``."""
        return cast(AttributeDict, super().hparams)

    def load_examples(self, files: list[str], split: str | None, name: str, split_key: str) -> list:
        """Validated, tokenized examples of ``files`` for ``split`` (``name`` is ``train`` or ``val``; ``split_key``
        is the setting named when the split is wrong)."""
        raise NotImplementedError

    def make_dataset(self, examples: list, name: str) -> Dataset:
        """The dataset of ``examples`` (``name`` is ``train`` or ``val``)."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        """Training data when ``stage`` fits, and the validation data (:func:`bundled_validation`, the given
        files, a held-out slice, or none), chosen once and announced in one line on global rank 0."""
        hp = self.hparams
        need_train = stage in (None, "fit") and self.train_set is None
        if self._val_chosen and not need_train:
            return
        train_files = file_list(hp.train_files)
        val_files, reason = None, "data.val_files"
        if hp.val_files == AUTO:
            val_files, reason = bundled_validation(train_files), "bundled with the training task"
        elif hp.val_files:
            val_files = file_list(hp.val_files)
        hold = not self._val_chosen and hp.val_files == AUTO and val_files is None and hp.val_size != 0
        train = self.load_examples(train_files, hp.split, "train", "data.split") if need_train or hold else None
        if not self._val_chosen:
            self._val_chosen = True
            val = None
            if val_files:
                val = self.load_examples(val_files, hp.val_split, "val", "data.val_split")
                line = f"validation: {', '.join(val_files)} ({reason})"
            elif hold:
                assert train is not None  # loaded above whenever rows are held out
                if isinstance(hp.val_size, float) and len(train) < 2:
                    line = (
                        f"validation: none ({', '.join(train_files)} has {len(train)} row, too few to hold out "
                        f"data.val_size {hp.val_size})"
                    )
                else:
                    count = held_out_count(hp.val_size, len(train))
                    if count >= len(train):
                        raise AlignDataError(
                            ", ".join(train_files),
                            None,
                            None,
                            f"more than the {count} rows "
                            f"data.val_size={hp.val_size} holds out for validation (or set "
                            "data.val_size 0, or give data.val_files)",
                            f"{len(train)} rows",
                        )
                    line = held_out_line(count, len(train), ", ".join(train_files), hp.val_size, hp.seed)
                    train, val = hold_out(train, count, hp.seed)
            else:
                line = (
                    "validation: none ("
                    + ("data.val_size is 0" if hp.val_files == AUTO else "data.val_files is null")
                    + ")"
                )
            self.val_set = self.make_dataset(val, "val") if val else None
            notice(line)
        if train is not None:
            self.train_set = self.make_dataset(train, "train")

    @staticmethod
    def no_validation() -> list[DataLoader]:
        """What ``val_dataloader`` returns without validation data: no loaders, which Lightning skips. Its warning
        that the validation data is empty is silenced: the choice was announced at setup."""
        warnings.filterwarnings("ignore", message=r"Total length of `list` across ranks is zero")
        return []

    def set_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def _resolve_tokenizer(self) -> Any:
        if self.tokenizer is None:
            if self.hparams.get("tokenizer") is not None:
                from align.hub import load_tokenizer

                self.tokenizer = load_tokenizer(self.hparams.tokenizer)
            elif self.trainer is not None and hasattr(self.trainer.lightning_module, "tokenizer"):
                self.tokenizer = self.trainer.lightning_module.tokenizer
            else:
                raise AlignConfigError(
                    "data.tokenizer: expected a tokenizer path, or a module with a policy to take it from, got None"
                )
        return self.tokenizer

    def encoder(self) -> ChatEncoder:
        return ChatEncoder(self._resolve_tokenizer(), self.hparams.get("use_chat_template"))

    def window_dataloader(self, dataset: Dataset, weights: Sequence[int], collate_fn: Callable) -> DataLoader:
        """Training batches whose items carry their optimizer step's total weight (see ``WindowBatchSampler``):
        shuffled when ``hparams.shuffle``, ``hparams.batch_size`` per micro-batch, one window per optimizer step.
        The loader resumes mid-epoch exactly (see ``align.data.sampling``)."""
        hp = self.hparams
        accumulate = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        batch_sampler = WindowBatchSampler(
            self._train_sampler(dataset), hp.batch_size, drop_last=False, weights=weights, accumulate=accumulate
        )
        return ResumableDataLoader(
            dataset, batch_sampler=batch_sampler, collate_fn=collate_fn, num_workers=hp.num_workers
        )

    def resumable_dataloader(self, dataset: Dataset, collate_fn: Callable, drop_last: bool = False) -> DataLoader:
        """Training batches of ``hparams.batch_size``, shuffled when ``hparams.shuffle``, that resume mid-epoch
        exactly (see ``align.data.sampling``)."""
        hp = self.hparams
        batch_sampler = ResumableBatchSampler(self._train_sampler(dataset), hp.batch_size, drop_last=drop_last)
        return ResumableDataLoader(
            dataset, batch_sampler=batch_sampler, collate_fn=collate_fn, num_workers=hp.num_workers
        )

    def _train_sampler(self, dataset: Dataset):
        # Shuffled by (seed_everything's seed, epoch), never by the global RNG: an epoch's order survives a restart.
        return EpochRandomSampler(dataset) if self.hparams.shuffle else EpochSequentialSampler(dataset)

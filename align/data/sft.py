"""SFT data: validation, tokenization, optional packing and collation into :class:`SFTBatch`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch.utils.data import DataLoader, Dataset

from align.core.packing import first_fit_decreasing
from align.data.base import AUTO, TokenizerDataModule, check_loader_settings, check_setting
from align.data.chat import IGNORE_INDEX, ChatEncoder
from align.data.formats import UnusedColumns, sft_record
from align.data.io import numbered, read_rows
from align.errors import AlignDataError

log = logging.getLogger(__name__)

Truncation = Literal["error", "right", "drop"]


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # aligned with input_ids; IGNORE_INDEX where no loss
    position_ids: list[int]  # restart at 0 at each packed segment

    @property
    def loss_tokens(self) -> int:
        # labels[0] is never predicted (nothing precedes it)
        return sum(1 for t in self.labels[1:] if t != IGNORE_INDEX)


@dataclass
class SFTBatch:
    input_ids: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, T), IGNORE_INDEX on prompt and padding
    position_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor | None  # (B, T); None for packed rows, whose boundaries live in position_ids
    window_tokens: torch.Tensor  # () loss tokens in this rank's whole accumulation window
    num_tokens: int  # real (non-pad) tokens, for throughput

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def tokenize_rows(
    rows: Sequence[dict],
    source: str,
    encoder: ChatEncoder,
    *,
    max_length: int,
    truncation: Truncation = "error",
    completion_only: bool = True,
    ignore_columns: frozenset = frozenset(),
    system_prompt: str | None = None,
    strict: bool = False,
) -> tuple[list[Example], int]:
    """Validate and tokenize every row. Returns the examples and the number of rows dropped.

    Columns the row's shape does not use are reported once for the file, or refused when ``strict``."""
    examples, dropped = [], 0
    unused = UnusedColumns(source, strict)
    for index, row in numbered(rows):
        record = sft_record(row, source, index, ignore_columns, system_prompt, unused)
        if record.text is not None:
            ids, labels = encoder.encode_text(record.text)
        else:
            assert record.messages is not None  # sft_record gives a row either its text or its messages
            ids, labels = encoder.encode(record.messages, source, index)
            if not completion_only:
                labels = list(ids)
        if len(ids) > max_length:
            if truncation == "error":
                raise AlignDataError(
                    source,
                    index,
                    None,
                    f"at most max_length={max_length} tokens (or set data.truncation to 'right' or 'drop')",
                    f"{len(ids)} tokens",
                )
            if truncation == "drop":
                dropped += 1
                continue
            ids, labels = ids[:max_length], labels[:max_length]
        example = Example(ids, labels, list(range(len(ids))))
        if example.loss_tokens == 0:
            if truncation == "right" and len(ids) == max_length:
                dropped += 1  # truncation removed every trained token
                continue
            raise AlignDataError(source, index, None, "a row with at least one token to train on")
        examples.append(example)
    unused.report()
    return examples, dropped


def pack(examples: Sequence[Example], max_length: int) -> list[Example]:
    """First-fit-decreasing packing into rows of at most ``max_length`` tokens.

    Each segment keeps its own positions (restarting at 0), and its first label is ignored so nothing is
    predicted across a boundary. The model sees no attention across segments (see ``SFTBatch``).
    """
    packed = []
    for members in first_fit_decreasing([len(ex.input_ids) for ex in examples], max_length):
        ids, labels, pos = [], [], []
        for i in members:
            ex = examples[i]
            ids += ex.input_ids
            labels += [IGNORE_INDEX] + ex.labels[1:]
            pos += ex.position_ids
        packed.append(Example(ids, labels, pos))
    return packed


class ExampleDataset(Dataset):
    """Items are looked up by index, or by ``(index, window_tokens)`` from :class:`WindowBatchSampler`."""

    def __init__(self, examples: list[Example]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, key):
        index, window = key if isinstance(key, tuple) else (key, None)
        return self.examples[index], window


class SFTCollator:
    def __init__(self, pad_token_id: int, packed: bool, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.packed = packed
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, items: list[tuple[Example, int | None]]) -> SFTBatch:
        examples = [ex for ex, _ in items]
        T = max(len(ex.input_ids) for ex in examples)
        if self.pad_to_multiple_of:
            T = -(-T // self.pad_to_multiple_of) * self.pad_to_multiple_of
        B = len(examples)
        input_ids = torch.full((B, T), self.pad_token_id, dtype=torch.long)
        labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((B, T), dtype=torch.long)
        # Padding gets positions of its own segment (0, 1, ...) so packed rows never attend into it.
        position_ids = torch.zeros((B, T), dtype=torch.long)
        for b, ex in enumerate(examples):
            n = len(ex.input_ids)
            input_ids[b, :n] = torch.tensor(ex.input_ids)
            labels[b, :n] = torch.tensor(ex.labels)
            attention_mask[b, :n] = 1
            position_ids[b, :n] = torch.tensor(ex.position_ids)
            position_ids[b, n:] = torch.arange(T - n)
        windows = {w for _, w in items}
        window = (
            cast(int, windows.pop())  # not None: None is not in windows
            if len(windows) == 1 and None not in windows
            else sum(ex.loss_tokens for ex in examples)
        )
        return SFTBatch(
            input_ids=input_ids,
            labels=labels,
            position_ids=position_ids,
            attention_mask=None if self.packed else attention_mask,
            window_tokens=torch.tensor(float(window)),
            num_tokens=int(attention_mask.sum()),
        )


class SFTDataModule(TokenizerDataModule):
    def __init__(
        self,
        train_files: str | list[str] = "align:sort/sft/train.jsonl",
        val_files: str | list[str] | None = AUTO,
        val_size: int | float = 0.05,
        seed: int = 0,
        tokenizer: str | None = None,
        max_length: int = 512,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        packing: bool = False,
        completion_only: bool = True,
        truncation: Truncation = "error",
        use_chat_template: bool | None = None,
        system_prompt: str | None = None,
        ignore_columns: list[str] | None = None,
        strict: bool = False,
        split: str = "train",
        val_split: str | None = None,
        shuffle: bool = True,
        num_workers: int = 0,
    ):
        """
        Args:
            train_files: Training data: jsonl/json/parquet/csv files, save_to_disk folders, ``align:...`` bundled
                files, or hub datasets ``org/name[:config]`` (docs/data.md).
            val_files: Validation data; ``auto``: the bundled task's validation file for bundled training files,
                else ``val_size`` rows held out of the training data; null: no validation.
            val_size: Rows held out of the user's training data under ``val_files: auto``: a count, or a fraction
                (0.05); 0 for no validation.
            seed: Seed of the held-out rows' selection.
            tokenizer: Tokenizer path or id; null uses the policy's.
            max_length: Longest allowed row (and packed row) in tokens.
            batch_size: Micro-batch size per device; the trainer's ``accumulate_grad_batches`` multiplies it.
            val_batch_size: Validation batch size (defaults to ``batch_size``).
            packing: Pack several examples into each row; positions restart and no attention crosses examples.
            completion_only: Train on assistant/completion tokens only (``text`` rows are always trained in full).
            truncation: Rows over ``max_length``: ``error`` names the row, ``right`` cuts the end, ``drop`` skips it.
            use_chat_template: Apply the tokenizer's chat template; null uses it when the tokenizer has one.
            system_prompt: A system message added to every conversation that has none.
            ignore_columns: Columns to skip silently (other unused columns are ignored with a one-line notice).
            strict: Refuse a row with a column its shape does not use, instead of the notice.
            split: Split of ``train_files``, sliceable as in ``train[:1000]`` or ``train[10%:]`` (a file has only
                ``train``).
            val_split: Split of ``val_files``; null: ``train`` for a file, ``validation`` for a hub dataset or a
                DatasetDict folder.
            shuffle: Shuffle training rows each epoch (seeded by ``seed_everything``).
            num_workers: DataLoader worker processes.
        """
        super().__init__()
        check_setting(truncation in ("error", "right", "drop"), "truncation", "'error', 'right' or 'drop'", truncation)
        self.save_hyperparameters()
        check_loader_settings(self.hparams)

    def load_examples(self, files: list[str], split: str | None, name: str, split_key: str) -> list[Example]:
        hp = self.hparams
        encoder = self.encoder()
        examples, dropped_total = [], 0
        for source in files:
            rows = read_rows(source, split, split_key)
            found, dropped = tokenize_rows(
                rows,
                source,
                encoder,
                max_length=hp.max_length,
                truncation=hp.truncation,
                completion_only=hp.completion_only,
                ignore_columns=frozenset(hp.ignore_columns or ()),
                system_prompt=hp.system_prompt,
                strict=hp.strict,
            )
            examples += found
            dropped_total += dropped
            if dropped:
                log.warning(
                    "%s: dropped %d of %d rows longer than max_length=%d", source, dropped, len(rows), hp.max_length
                )
        if not examples:
            raise AlignDataError(", ".join(files), None, None, "at least one usable row after filtering")
        return examples

    def make_dataset(self, examples: list[Example], name: str) -> ExampleDataset:
        # Packed after the held-out split, so no validation row shares a packed row with a training one.
        return ExampleDataset(pack(examples, self.hparams.max_length) if self.hparams.packing else examples)

    def _collator(self) -> SFTCollator:
        return SFTCollator(self._resolve_tokenizer().pad_token_id, packed=self.hparams.packing)

    def train_dataloader(self) -> DataLoader:
        assert isinstance(self.train_set, ExampleDataset)  # setup("fit") made it with make_dataset
        return self.window_dataloader(
            self.train_set, [ex.loss_tokens for ex in self.train_set.examples], self._collator()
        )

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        if self.val_set is None:
            return self.no_validation()
        return DataLoader(
            self.val_set,
            batch_size=self.hparams.val_batch_size or self.hparams.batch_size,
            shuffle=False,
            collate_fn=self._collator(),
            num_workers=self.hparams.num_workers,
        )

"""RL prompt data: ``{"prompt", ...}`` rows -> token ids with the chat template applied once, plus columns.

A prompt is a string (one user message) or a list of ``{role, content}`` messages not ending with an
assistant turn. Every other column (for example ``answer``) is kept and passed to the reward functions as a
keyword argument, one value per completion. Rows are validated up front: a row without the prompt field,
or with an empty or malformed prompt, fails with the file, the row and the field.

Held-out prompts for ``val/reward_mean`` are chosen as for every data module (:mod:`align.data.base`): the bundled
task's validation prompts, the given ``val_files``, or a seeded ``val_size`` slice of the user's prompts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, Dataset

from align.data.base import AUTO, TokenizerDataModule, check_loader_settings
from align.data.chat import ChatEncoder
from align.data.formats import prompt_messages
from align.data.io import numbered, read_rows
from align.errors import AlignDataError

log = logging.getLogger(__name__)


REWARD_INPUTS = ("prompt_messages", "completion_ids", "completion_truncated", "conversation")
"""Keyword arguments every reward receives besides the data's columns (docs/rewards.md); no column may take
these names."""


@dataclass
class PromptExample:
    prompt_ids: list[int]  # chat template applied, ready for generation
    prompt: str  # the prompt text given to reward functions
    columns: dict[str, Any]  # every other column of the row
    messages: list[dict]  # the whole prompt conversation (system prompt included) as generated from


@dataclass
class PromptBatch:
    """``B`` prompts. Rewards see ``prompts``, ``messages`` and ``columns``; the rollout engine pads ``prompt_ids``."""

    prompt_ids: list[list[int]]  # B token id lists, unpadded
    prompts: list[str]  # B prompt texts
    columns: dict[str, list]  # column name -> B values
    messages: list[list[dict]] | None = None  # B prompt conversations; None: one user message per prompt text

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def repeat(self, group_size: int) -> tuple[list[str], dict[str, list]]:
        """Prompts and columns with each entry repeated ``group_size`` times, aligned with a rollout's rows."""
        prompts = [p for p in self.prompts for _ in range(group_size)]
        columns = {k: [v for v in values for _ in range(group_size)] for k, values in self.columns.items()}
        return prompts, columns

    def repeat_messages(self, group_size: int) -> list[list[dict]]:
        """Each prompt's conversation, repeated ``group_size`` times (a one-message conversation when unknown)."""
        messages = self.messages or [[{"role": "user", "content": p}] for p in self.prompts]
        return [m for m in messages for _ in range(group_size)]


def prompt_text(messages: list[dict]) -> str:
    """The text reward functions see: the content of the last message (the user's request)."""
    return messages[-1]["content"]


def encode_prompt_rows(
    rows: list[dict],
    source: str,
    encoder: ChatEncoder,
    *,
    prompt_field: str = "prompt",
    max_prompt_length: int | None = None,
    system_prompt: str | None = None,
    ignore_columns: frozenset = frozenset(),
) -> list[PromptExample]:
    """Validate and encode every row (rows numbered as in their source, from 1, in errors)."""
    examples = []
    for index, row in numbered(rows):
        if prompt_field not in row:
            raise AlignDataError(
                source,
                index,
                prompt_field,
                f"a row with a '{prompt_field}' field (a string or a list of messages)",
                f"fields {sorted(row)}",
            )
        messages = prompt_messages(row[prompt_field], source, index, prompt_field, system_prompt)
        ids = encoder.prompt_ids(messages)
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            raise AlignDataError(
                source,
                index,
                prompt_field,
                f"at most max_prompt_length={max_prompt_length} tokens",
                f"{len(ids)} tokens",
            )
        columns = {k: v for k, v in row.items() if k != prompt_field and k not in ignore_columns}
        clash = sorted(set(columns) & set(REWARD_INPUTS))
        if clash:
            raise AlignDataError(
                source,
                index,
                clash[0],
                f"a column name other than {clash[0]!r}, which rewards "
                "receive from the rollout (see docs/rewards.md); rename the column",
            )
        examples.append(PromptExample(ids, prompt_text(messages), columns, messages))
    return examples


class PromptDataset(Dataset):
    def __init__(self, examples: list[PromptExample]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> PromptExample:
        return self.examples[index]


def collate_prompts(examples: list[PromptExample]) -> PromptBatch:
    keys = sorted({k for ex in examples for k in ex.columns})
    return PromptBatch(
        prompt_ids=[ex.prompt_ids for ex in examples],
        prompts=[ex.prompt for ex in examples],
        columns={k: [ex.columns.get(k) for ex in examples] for k in keys},
        messages=[ex.messages for ex in examples],
    )


class PromptDataModule(TokenizerDataModule):
    def __init__(
        self,
        train_files: str | list[str] = "align:sort/prompts/train.jsonl",
        val_files: str | list[str] | None = AUTO,
        val_size: int | float = 0.05,
        seed: int = 0,
        tokenizer: str | None = None,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        max_prompt_length: int | None = 256,
        prompt_field: str = "prompt",
        system_prompt: str | None = None,
        use_chat_template: bool | None = None,
        ignore_columns: list[str] | None = None,
        split: str = "train",
        val_split: str | None = None,
        shuffle: bool = True,
        num_workers: int = 0,
    ):
        """
        Args:
            train_files: Prompt data ``{prompt, ...}``: jsonl/json/parquet/csv files, save_to_disk folders,
                ``align:...`` bundled files, or hub datasets ``org/name[:config]`` (docs/data.md).
            val_files: Held-out prompts for ``val/reward_mean``; ``auto``: the bundled task's validation prompts for
                bundled training files, else ``val_size`` prompts held out of the training data; null: none.
            val_size: Prompts held out of the user's training data under ``val_files: auto``: a count, or a
                fraction (0.05); 0 for no validation.
            seed: Seed of the held-out prompts' selection.
            tokenizer: Tokenizer path or id; null uses the policy's.
            batch_size: Prompts per rollout on each device (each is sampled ``group_size`` times).
            val_batch_size: Prompts per validation batch (defaults to ``batch_size``).
            max_prompt_length: Longest allowed prompt in tokens (the row is named if one is longer); null: no limit.
            prompt_field: Name of the prompt column; every other column is passed to the rewards.
            system_prompt: A system message added to every prompt that has none.
            use_chat_template: Apply the tokenizer's chat template; null uses it when the tokenizer has one.
            ignore_columns: Columns not passed to the rewards (every other column is).
            split: Split of ``train_files``, sliceable as in ``train[:1000]`` or ``train[10%:]`` (a file has only
                ``train``).
            val_split: Split of ``val_files``; null: ``train`` for a file, ``validation`` for a hub dataset or a
                DatasetDict folder.
            shuffle: Shuffle training prompts each epoch (seeded by ``seed_everything``).
            num_workers: DataLoader worker processes.
        """
        super().__init__()
        self.save_hyperparameters()
        check_loader_settings(self.hparams)

    def load_examples(self, files: list[str], split: str | None, name: str, split_key: str) -> list[PromptExample]:
        hp = self.hparams
        encoder = self.encoder()
        examples: list[PromptExample] = []
        for source in files:
            examples += encode_prompt_rows(
                read_rows(source, split, split_key),
                source,
                encoder,
                prompt_field=hp.prompt_field,
                max_prompt_length=hp.max_prompt_length,
                system_prompt=hp.system_prompt,
                ignore_columns=frozenset(hp.ignore_columns or ()),
            )
        return examples

    def make_dataset(self, examples: list[PromptExample], name: str) -> PromptDataset:
        return PromptDataset(examples)

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        assert isinstance(self.train_set, PromptDataset)  # setup("fit") made it with make_dataset
        # Full batches only (every rollout has the same shape), unless the data is smaller than one batch.
        drop_last = len(self.train_set) >= hp.batch_size
        return self.resumable_dataloader(self.train_set, collate_prompts, drop_last=drop_last)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        if self.val_set is None:
            return self.no_validation()
        return DataLoader(
            self.val_set,
            batch_size=self.hparams.val_batch_size or self.hparams.batch_size,
            shuffle=False,
            collate_fn=collate_prompts,
            num_workers=self.hparams.num_workers,
        )

    def transfer_batch_to_device(self, batch, device, dataloader_idx: int):
        return batch  # token id lists stay on the host; the rollout engine moves the padded tensors


__all__ = ["PromptBatch", "PromptDataModule", "PromptExample", "collate_prompts", "encode_prompt_rows"]

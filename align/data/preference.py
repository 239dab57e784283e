"""Preference data modules: :class:`PreferenceDataModule` (pairs, for DPO and reward models) and
:class:`UnpairedDataModule` (KTO), their dataset and the collation of pairs into :class:`PreferenceBatch`.

The rows' shapes, their validation and their tokenization are in :mod:`align.data.preference_rows` (docs/data.md,
"Preference"); counts of what was truncated or dropped are logged per file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import torch
from torch.utils.data import DataLoader, Dataset

from align.data.base import AUTO, TokenizerDataModule, check_loader_settings, check_setting
from align.data.io import read_rows
from align.data.preference_rows import (  # noqa: F401  (encode_prompt, encode_response, fit_prompt: align.rollout.rewards.reward_model)
    IdenticalPairs,
    PreferenceExample,
    PreparedSplit,
    Truncation,
    encode_prompt,
    encode_response,
    fingerprint_examples,
    fit_prompt,
    mismatch_completions,
    tokenize_preference_rows,
)
from align.errors import AlignDataError

log = logging.getLogger(__name__)


@dataclass
class PreferenceBatch:
    """A micro-batch of ``B`` pairs laid out for one concatenated forward pass.

    Rows ``0..B-1`` hold prompt + chosen and rows ``B..2B-1`` prompt + rejected, for the same pairs in the same
    order. Each row is ``[left-padded prompt (P) | right-padded response (R)]``, ``T = P + R``, so the last ``R``
    positions are the responses of every row (``PolicyModel.token_logprobs(..., response_length=R)``). Positions come
    from the attention mask, so the left padding does not shift them.
    """

    input_ids: torch.Tensor  # (2B, T)
    attention_mask: torch.Tensor  # (2B, T) 1 on real tokens
    response_mask: torch.Tensor  # (2B, R) 1 on response tokens (turn end and EOS included)
    margin: torch.Tensor  # (B,) float32 preference margin (0 where the data has none)
    index: torch.Tensor  # (B,) long: position of each pair in its dataset (keys the reference cache)
    window_pairs: torch.Tensor  # () pairs in this rank's whole accumulation window
    num_tokens: int  # real (non-pad) tokens, for throughput
    label: torch.Tensor | None = None  # (B,) bool, unpaired examples only: whether rows 0..B-1 are desirable

    @property
    def num_pairs(self) -> int:
        return self.input_ids.shape[0] // 2

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    def __len__(self) -> int:
        return self.num_pairs


class PreferenceDataset(Dataset):
    """Items by index, or by ``(index, window_pairs)`` from :class:`WindowBatchSampler`."""

    def __init__(self, examples: list[PreferenceExample]):
        self.examples = examples
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, key):
        index, window = key if isinstance(key, tuple) else (key, None)
        return index, self.examples[index], window

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = fingerprint_examples(self.examples)
        return self._fingerprint


class PreferenceCollator:
    """Pads pairs into a :class:`PreferenceBatch`: prompts on the left, responses on the right."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, items: list[tuple[int, PreferenceExample, int | None]]) -> PreferenceBatch:
        examples = [ex for _, ex, _ in items]
        B = len(examples)
        P = max(len(ex.prompt_ids) for ex in examples)
        R = max(max(len(ex.chosen_ids), len(ex.rejected_ids)) for ex in examples)
        if self.pad_to_multiple_of:
            R = -(-(P + R) // self.pad_to_multiple_of) * self.pad_to_multiple_of - P
        input_ids = torch.full((2 * B, P + R), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((2 * B, P + R), dtype=torch.long)
        response_mask = torch.zeros((2 * B, R), dtype=torch.long)
        for b, ex in enumerate(examples):
            p = len(ex.prompt_ids)
            for row, response in ((b, ex.chosen_ids), (B + b, ex.rejected_ids)):
                n = len(response)
                input_ids[row, P - p : P] = torch.tensor(ex.prompt_ids)
                input_ids[row, P : P + n] = torch.tensor(response)
                attention_mask[row, P - p : P + n] = 1
                response_mask[row, :n] = 1
        windows = {w for _, _, w in items}
        window = cast(int, windows.pop()) if len(windows) == 1 and None not in windows else B  # None is not in windows
        return PreferenceBatch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            response_mask=response_mask,
            margin=torch.tensor([ex.margin for ex in examples], dtype=torch.float32),
            index=torch.tensor([i for i, _, _ in items], dtype=torch.long),
            window_pairs=torch.tensor(float(window)),
            num_tokens=int(attention_mask.sum()),
            label=None if examples[0].label is None else torch.tensor([ex.label for ex in examples]),
        )


class PreferenceDataModule(TokenizerDataModule):
    unpaired = False  # whether examples are KTO's unpaired ones (:class:`UnpairedDataModule`)

    def __init__(
        self,
        train_files: str | list[str] = "align:sort/preference/train.jsonl",
        val_files: str | list[str] | None = AUTO,
        val_size: int | float = 0.05,
        seed: int = 0,
        tokenizer: str | None = None,
        max_length: int = 512,
        max_prompt_length: int | None = None,
        truncation: Truncation = "left",
        identical_pairs: IdenticalPairs = "drop",
        batch_size: int = 8,
        val_batch_size: int | None = None,
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
            train_files: Training pairs (``{prompt, chosen, rejected}`` or ``{chosen, rejected}``, docs/data.md):
                jsonl/json/parquet/csv files, save_to_disk folders, ``align:...`` bundled files, or hub datasets
                ``org/name[:config]``.
            val_files: Validation pairs; ``auto``: the bundled task's validation file for bundled training files,
                else ``val_size`` pairs held out of the training data; null: no validation.
            val_size: Pairs held out of the user's training data under ``val_files: auto``: a count, or a fraction
                (0.05); 0 for no validation.
            seed: Seed of the held-out pairs' selection.
            tokenizer: Tokenizer path or id; null uses the policy's.
            max_length: Longest allowed prompt + response, in tokens (the longer response counts).
            max_prompt_length: Longest allowed prompt in tokens; null means only ``max_length`` applies.
            truncation: Prompts too long: ``left`` keeps their last tokens, ``drop`` skips the row (counted),
                ``error`` names the row. Responses are never cut.
            identical_pairs: Rows whose chosen equals rejected (always warned and counted): ``drop``, ``keep`` or
                ``error``.
            batch_size: Pairs per micro-batch per device; the trainer's ``accumulate_grad_batches`` multiplies it.
            val_batch_size: Validation pairs per batch (defaults to ``batch_size``).
            use_chat_template: Apply the tokenizer's chat template; null uses it when the tokenizer has one.
            system_prompt: A system message added to every prompt that has none.
            ignore_columns: Columns to skip silently (other unused columns are ignored with a one-line notice).
            strict: Refuse a row with a column its shape does not use, instead of the notice.
            split: Split of ``train_files``, sliceable as in ``train[:1000]`` or ``train[10%:]`` (a file has only
                ``train``).
            val_split: Split of ``val_files``; null: ``train`` for a file, ``validation`` for a hub dataset or a
                DatasetDict folder.
            shuffle: Shuffle training pairs each epoch (seeded by ``seed_everything``).
            num_workers: DataLoader worker processes.
        """
        super().__init__()
        check_setting(truncation in ("left", "drop", "error"), "truncation", "'left', 'drop' or 'error'", truncation)
        check_setting(
            identical_pairs in ("drop", "keep", "error"),
            "identical_pairs",
            "'drop', 'keep' or 'error'",
            identical_pairs,
        )
        self.save_hyperparameters()
        check_loader_settings(self.hparams)
        self.stats: dict[str, PreparedSplit] = {}

    def encoding_spec(self) -> dict:
        """What a scorer needs to encode text the way training did (saved with reward-model exports)."""
        hp = self.hparams
        return {
            "use_chat_template": self.encoder().use_chat_template,
            "system_prompt": hp.system_prompt,
            "max_length": hp.max_length,
            "max_prompt_length": hp.max_prompt_length,
        }

    def load_examples(self, files: list[str], split: str | None, name: str, split_key: str) -> list[PreferenceExample]:
        hp = self.hparams
        encoder = self.encoder()
        total = PreparedSplit()
        for source in files:
            found = tokenize_preference_rows(
                read_rows(source, split, split_key),
                source,
                encoder,
                max_length=hp.max_length,
                max_prompt_length=hp.max_prompt_length,
                truncation=hp.truncation,
                identical_pairs=hp.identical_pairs,
                ignore_columns=frozenset(hp.ignore_columns or ()),
                system_prompt=hp.system_prompt,
                strict=hp.strict,
                unpaired=self.unpaired,
            )
            if found.identical:
                log.warning(
                    "%s: %d of %d rows have chosen == rejected (%s)",
                    source,
                    found.identical,
                    found.rows,
                    "dropped" if found.dropped_identical else "kept",
                )
            if found.truncated:
                log.warning(
                    "%s: truncated the prompt (from the left) of %d of %d rows to fit max_length=%d",
                    source,
                    found.truncated,
                    found.rows,
                    hp.max_length,
                )
            if found.dropped_long:
                log.warning(
                    "%s: dropped %d of %d rows longer than max_length=%d",
                    source,
                    found.dropped_long,
                    found.rows,
                    hp.max_length,
                )
            total.examples += found.examples
            for key in ("rows", "truncated", "dropped_long", "identical", "dropped_identical"):
                setattr(total, key, getattr(total, key) + getattr(found, key))
        if not total.examples:
            raise AlignDataError(", ".join(files), None, None, "at least one usable pair after filtering")
        self.stats[name] = total  # counts of the files read (before any held-out split)
        return total.examples

    def make_dataset(self, examples: list[PreferenceExample], name: str) -> PreferenceDataset:
        return PreferenceDataset(examples)

    def collator(self) -> PreferenceCollator:
        return PreferenceCollator(self._resolve_tokenizer().pad_token_id)

    def train_dataloader(self) -> DataLoader:
        assert isinstance(self.train_set, PreferenceDataset)  # setup("fit") made it with make_dataset
        # Every pair weighs 1: the loss of an optimizer step is a mean over the pairs of its whole window.
        return self.window_dataloader(self.train_set, [1] * len(self.train_set), self.collator())

    def eval_dataloader(self, dataset: Dataset, batch_size: int | None = None) -> DataLoader:
        """In-order batches over ``dataset`` (validation, and reference precomputation)."""
        return DataLoader(
            dataset,
            batch_size=batch_size or self.hparams.val_batch_size or self.hparams.batch_size,
            shuffle=False,
            collate_fn=self.collator(),
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        if self.val_set is None:
            return self.no_validation()
        return self.eval_dataloader(self.val_set)


class UnpairedDataModule(PreferenceDataModule):
    """KTO's data: unpaired ``{prompt, completion, label}`` rows, and preference pairs each read as one desirable
    and one undesirable example (docs/data.md, "Unpaired preference"). The settings are
    :class:`PreferenceDataModule`'s (``identical_pairs`` applies to pairs; ``batch_size`` counts examples).

    Each example is laid out as a pair (:class:`PreferenceBatch`): rows ``0..B-1`` hold prompt + completion, rows
    ``B..2B-1`` the same prompt with another example's completion (:func:`mismatch_completions`), and
    ``PreferenceBatch.label`` says which completions are desirable. The training data must hold both labels.
    """

    unpaired = True

    def load_examples(self, files: list[str], split: str | None, name: str, split_key: str) -> list[PreferenceExample]:
        examples = super().load_examples(files, split, name, split_key)
        labels = {ex.label for ex in examples}
        if name == "train" and len(labels) < 2:
            raise AlignDataError(
                ", ".join(files),
                None,
                "label",
                "both desirable (true) and undesirable (false) examples: KTO's loss needs each kind",
                f"only label {labels.pop()}",
            )
        mismatch_completions(examples, self.hparams.seed, self.hparams.max_length)
        return examples

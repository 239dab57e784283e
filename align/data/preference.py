"""Preference data: validation, tokenization and collation into :class:`PreferenceBatch`.

Rows take TRL's preference shapes (docs/data.md, "Preference"), each reduced to a prompt (messages) and two
responses (one assistant message each):

* explicit prompt, ``{"prompt", "chosen", "rejected"}``: each field a string or a list of messages (the prompt may
  hold several turns, each response is one assistant message). UltraFeedback's shape, where ``chosen`` and
  ``rejected`` are whole conversations that start with the prompt's messages, is read the same way: the prompt's
  turns are stripped from each.
* implicit prompt, ``{"chosen", "rejected"}``: two whole conversations (lists of messages, or Anthropic HH text
  with ``\n\nHuman:``/``\n\nAssistant:`` turns) identical up to their final assistant message. That shared
  prefix is the prompt, and each final assistant message a response.

Unpaired rows ``{"prompt", "completion", "label"}`` (KTO; ``label`` true for a desirable completion, false for an
undesirable one) are read by :class:`UnpairedDataModule` only, which also reads the paired shapes above and turns
each pair into a desirable and an undesirable example. An optional ``margin`` column (a number, the Llama 2 preference strength, arXiv 2307.09288) is used
by the reward model's Bradley-Terry loss.

Tokenization applies the chat template once to the prompt plus each response (:class:`~align.data.chat.ChatEncoder`):
the prompt ids are the ids a rollout would generate from, and each response's ids are what the template adds after
them (the response text, its turn end and EOS). Chosen and rejected share the same prompt ids.

Handled explicitly, with counts logged per file:

* A prompt too long for ``max_length`` (or ``max_prompt_length``): ``truncation="left"`` keeps the prompt's last
  tokens and both full responses; ``"drop"`` skips the row; ``"error"`` stops with the file and row. A pair whose
  responses alone do not fit is dropped under ``"drop"`` and an error otherwise (responses are never cut).
* ``chosen == rejected``: a warning with the count; such a pair carries no preference, so it is dropped unless
  ``identical_pairs="keep"``.
* A missing or malformed field: :class:`~align.errors.AlignDataError` naming the file, row and field.
"""

from __future__ import annotations

import hashlib
import logging
import random
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from align.data.base import AUTO, TokenizerDataModule, check_val_size
from align.data.chat import ChatEncoder
from align.data.formats import (UnusedColumns, check_messages, completion_text, conversation, detect_format,
                                hh_messages, prompt_messages, row_system, with_system)
from align.data.io import numbered, read_rows
from align.errors import AlignDataError

log = logging.getLogger(__name__)

Truncation = Literal["left", "drop", "error"]
IdenticalPairs = Literal["drop", "keep", "error"]

PREFERENCE_FORMATS = {
    "explicit-prompt preference": (frozenset({"prompt", "chosen", "rejected"}), frozenset({"system", "margin"})),
    "implicit-prompt preference": (frozenset({"chosen", "rejected"}), frozenset({"system", "margin"})),
    "unpaired preference": (frozenset({"prompt", "completion", "label"}), frozenset({"system"})),
}


@dataclass
class PreferenceRecord:
    """A validated preference row: the prompt as messages and the two responses as text."""

    prompt: list[dict]
    chosen: str  # an unpaired row's completion
    rejected: str | None  # None for an unpaired row
    margin: float | None
    row: int
    source: str
    label: bool | None = None  # an unpaired row's label; None for a pair


@dataclass
class PreferenceExample:
    """One tokenized pair. ``prompt_ids + chosen_ids`` is the templated conversation with the chosen answer."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float = 0.0
    row: int = 0  # row number in its source file (from 1), for messages
    truncated: bool = False
    label: bool | None = None  # unpaired (KTO): whether ``chosen_ids`` is desirable; ``rejected_ids`` is then the
    # completion of another example, the mismatched pair of the KL estimate (:func:`mismatch_completions`)


@dataclass
class PreparedSplit:
    """What :func:`tokenize_preference_rows` kept, and what it counted on the way."""

    examples: list[PreferenceExample] = field(default_factory=list)
    rows: int = 0
    truncated: int = 0
    dropped_long: int = 0
    identical: int = 0
    dropped_identical: int = 0


@dataclass
class PreferenceBatch:
    """A micro-batch of ``B`` pairs laid out for one concatenated forward pass.

    Rows ``0..B-1`` hold prompt + chosen and rows ``B..2B-1`` prompt + rejected, for the same pairs in the same
    order. Each row is ``[left-padded prompt (P) | right-padded response (R)]``, ``T = P + R``, so the last ``R``
    positions are the responses of every row (``PolicyModel.token_logprobs(..., response_length=R)``). Positions come from
    the attention mask, so the left padding does not shift them.
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


def preference_record(row: dict, source: str, index: int, ignore: frozenset = frozenset(),
                      system_prompt: str | None = None, unused: UnusedColumns | None = None,
                      unpaired: bool = False) -> PreferenceRecord:
    """Validate one row of any accepted shape; errors name the file, the row and the field. Unpaired rows are
    accepted only when ``unpaired`` (KTO's data)."""
    for name, other in (("chosen", "rejected"), ("rejected", "chosen")):
        if other in row and name not in row:
            raise AlignDataError(source, index, name, f"a '{name}' field beside '{other}' in every preference row "
                                 "({prompt, chosen, rejected} or {chosen, rejected})", f"fields {sorted(row)}")
    fmt, extra = detect_format(row, PREFERENCE_FORMATS, source, index, ignore)
    if fmt == "unpaired preference" and not unpaired:
        raise AlignDataError(source, index, "label", "paired rows {prompt, chosen, rejected} or {chosen, rejected}: "
                             "unpaired {prompt, completion, label} rows are KTO's data (align.modules.kto.KTOModule "
                             "with align.data.preference.UnpairedDataModule)")
    if unused is not None:
        unused.check(index, fmt, extra, PREFERENCE_FORMATS[fmt][0] | PREFERENCE_FORMATS[fmt][1])
    system = row_system(row, source, index, system_prompt)
    margin = row.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin != margin):
        raise AlignDataError(source, index, "margin", "a number", margin)
    if fmt == "unpaired preference":
        if not isinstance(row["label"], bool):
            raise AlignDataError(source, index, "label", "true (a desirable completion) or false (an undesirable one)",
                                 row["label"])
        prompt = prompt_messages(row["prompt"], source, index, "prompt")
        completion = response_after(prompt, row["completion"], source, index, "completion")
        return PreferenceRecord(with_system(prompt, system), completion, None, None, index, source, row["label"])
    if fmt == "explicit-prompt preference":
        prompt = prompt_messages(row["prompt"], source, index, "prompt")
        chosen = response_after(prompt, row["chosen"], source, index, "chosen")
        rejected = response_after(prompt, row["rejected"], source, index, "rejected")
    else:
        if isinstance(row["chosen"], str) and hh_messages(row["chosen"], source, index, "chosen") is None:
            raise AlignDataError(source, index, "prompt", "a 'prompt' field when 'chosen' is plain text (without one, "
                                 "chosen and rejected are whole conversations: lists of messages, or Anthropic HH "
                                 "text)", f"fields {sorted(row)}")
        prompt, chosen, rejected = shared_prompt(conversation(row["chosen"], source, index, "chosen"),
                                                 conversation(row["rejected"], source, index, "rejected"),
                                                 source, index)
    return PreferenceRecord(with_system(prompt, system), chosen, rejected,
                            None if margin is None else float(margin), index, source)


def response_after(prompt: list[dict], value, source: str, index: int, field: str) -> str:
    """A response given as text, as one assistant message, or as a whole conversation that starts with the
    prompt's messages (UltraFeedback) and continues with one assistant message."""
    if not isinstance(value, list) or len(value) <= 1:
        return completion_text(value, source, index, field)
    messages = check_messages(value, source, index, field, need_assistant=True)
    if messages[:len(prompt)] != prompt or len(messages) != len(prompt) + 1 or messages[-1]["role"] != "assistant":
        raise AlignDataError(source, index, field, "a string, one assistant message, or a conversation made of the "
                             "prompt's messages followed by one assistant message", value)
    return messages[-1]["content"]


def shared_prompt(chosen: list[dict], rejected: list[dict], source: str, index: int) -> tuple[list[dict], str, str]:
    """Implicit prompt: ``(prompt, chosen reply, rejected reply)`` from two conversations identical up to their
    final assistant messages."""
    for name, messages in (("chosen", chosen), ("rejected", rejected)):
        if messages[-1]["role"] != "assistant" or len(messages) < 2:
            raise AlignDataError(source, index, name, "a conversation of at least one prompt message followed by the "
                                 "assistant's reply (an implicit-prompt row ends with one assistant message)",
                                 f"{len(messages)} messages ending with a {messages[-1]['role']} message")
    prompt = chosen[:-1]
    if rejected[:-1] != prompt:
        at = next((i for i, (a, b) in enumerate(zip(prompt, rejected[:-1])) if a != b), min(len(prompt), len(rejected) - 1))
        raise AlignDataError(source, index, "rejected", "the same messages as 'chosen' before the final assistant "
                             f"message (the shared prompt); they differ at message {at}")
    if prompt[-1]["role"] == "assistant":
        raise AlignDataError(source, index, "chosen", "a prompt (the shared messages) that does not end with an "
                             "assistant message", prompt[-1])
    return prompt, chosen[-1]["content"], rejected[-1]["content"]


def encode_response(encoder: ChatEncoder, prompt_ids: list[int], messages: list[dict], response: str,
                    source: str = "<data>", row: int | None = None, name: str = "response",
                    prompt_text: str | None = None) -> list[int]:
    """Ids the chat template adds after ``prompt_ids`` for ``response`` as the assistant's reply.

    With a chat template, prompt + response is rendered once and the text after the rendered prompt (the
    generation prompt included) is tokenized on its own, so no BPE merge crosses the boundary and the prompt ids
    stay exactly :meth:`ChatEncoder.prompt_ids`. ``prompt_text`` (the rendered prompt) saves a render per response.
    """
    if encoder.use_chat_template:
        if prompt_text is None:
            prompt_text = encoder._render(messages, add_generation_prompt=True)
        full = encoder._render(messages + [{"role": "assistant", "content": response}], add_generation_prompt=False)
        if not full.startswith(prompt_text) or len(full) == len(prompt_text):
            raise AlignDataError(source, row, name, "a chat template whose rendering of prompt + response starts with "
                                 "the rendering of the prompt (with its generation prompt)")
        ids = encoder._ids(full[len(prompt_text):])
        return ids[: encoder.until_eos(ids)]  # a response ends at its first EOS, as a sampled one does
    ids, _ = encoder.encode(messages + [{"role": "assistant", "content": response}], source, row)
    if ids[: len(prompt_ids)] != prompt_ids or len(ids) == len(prompt_ids):
        raise AlignDataError(source, row, name, "a tokenization of prompt + response that starts with the prompt's")
    return ids[len(prompt_ids):]


def encode_prompt(encoder: ChatEncoder, messages: list[dict]) -> tuple[list[int], str | None]:
    """``(prompt ids, rendered prompt text or None without a chat template)``: render once, reuse per response."""
    if encoder.use_chat_template:
        text = encoder._render(messages, add_generation_prompt=True)
        return encoder._ids(text), text
    return encoder.prompt_ids(messages), None


def fit_prompt(prompt_ids: list[int], response_len: int, max_length: int, max_prompt_length: int | None) -> int:
    """How many prompt tokens fit (keeping the last ones); 0 when the responses alone leave no room."""
    budget = max_length - response_len
    if max_prompt_length is not None:
        budget = min(budget, max_prompt_length)
    return max(0, min(len(prompt_ids), budget))


def tokenize_preference_rows(
    rows: Sequence[dict],
    source: str,
    encoder: ChatEncoder,
    *,
    max_length: int,
    max_prompt_length: int | None = None,
    truncation: Truncation = "left",
    identical_pairs: IdenticalPairs = "drop",
    ignore_columns: frozenset = frozenset(),
    system_prompt: str | None = None,
    strict: bool = False,
    unpaired: bool = False,
) -> PreparedSplit:
    """Validate and tokenize every row of one file (unused columns: one notice, or an error when ``strict``).

    ``unpaired`` (KTO): unpaired rows give one example each, and each pair a desirable example (its chosen
    response) and an undesirable one (its rejected response), sharing the pair's prompt ids; every example's
    ``rejected_ids`` is left empty for :func:`mismatch_completions`.
    """
    out = PreparedSplit(rows=len(rows))
    unused = UnusedColumns(source, strict)
    for index, row in numbered(rows):
        record = preference_record(row, source, index, ignore_columns, system_prompt, unused, unpaired)
        if record.chosen == record.rejected:
            out.identical += 1
            if identical_pairs == "error":
                raise AlignDataError(source, index, "rejected", "a response different from 'chosen' (or set "
                                     "data.identical_pairs to 'drop' or 'keep')", record.rejected)
            if identical_pairs == "drop":
                out.dropped_identical += 1
                continue
        prompt_ids, prompt_text = encode_prompt(encoder, record.prompt)
        responses = ([("completion", record.chosen, record.label)] if record.label is not None else
                     [("chosen", record.chosen, True), ("rejected", record.rejected, False)])
        ids = [encode_response(encoder, prompt_ids, record.prompt, text, source, index, name, prompt_text)
               for name, text, _ in responses]
        longest = max(map(len, ids))
        keep = fit_prompt(prompt_ids, longest, max_length, max_prompt_length)
        truncated = keep < len(prompt_ids)
        if truncated:
            if truncation == "drop":
                out.dropped_long += 1
                continue
            if keep == 0 or truncation == "error":
                what = ("responses of at most max_length - 1 tokens" if keep == 0 else
                        "a prompt that fits max_length/max_prompt_length (or set data.truncation to 'left' or 'drop')")
                raise AlignDataError(source, index, None, f"{what} (max_length={max_length}, max_prompt_length="
                                     f"{max_prompt_length})", f"prompt {len(prompt_ids)} + response {longest} tokens")
            prompt_ids = prompt_ids[len(prompt_ids) - keep:]
            out.truncated += 1
        if unpaired:
            out.examples += [PreferenceExample(prompt_ids, r, [], 0.0, index, truncated, label)
                             for r, (_, _, label) in zip(ids, responses)]
        else:
            out.examples.append(PreferenceExample(prompt_ids, ids[0], ids[1], record.margin or 0.0, index, truncated))
    unused.report()
    return out


def mismatch_completions(examples: list[PreferenceExample], seed: int, max_length: int) -> None:
    """Set each unpaired example's ``rejected_ids`` to another example's completion: the mismatched
    (prompt, completion) pairs from which KTO estimates its reference point z0 (arXiv 2402.01306, section 4.1).

    In a seeded shuffle each example takes the next one's completion, cut to fit ``max_length`` after its prompt
    (it only enters the KL estimate). The pairing is fixed once, so the reference log-probs of the KL rows can be
    cached like the rest (``precompute_reference``).
    """
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    for k, i in enumerate(order):
        ex = examples[i]
        ex.rejected_ids = examples[order[(k + 1) % len(order)]].chosen_ids[: max_length - len(ex.prompt_ids)]


def fingerprint_examples(examples: Sequence[PreferenceExample]) -> str:
    """A sha256 of every pair's token ids and margin, in order: the data half of the reference-cache key."""
    h = hashlib.sha256()
    for ex in examples:
        for part in (ex.prompt_ids, ex.chosen_ids, ex.rejected_ids):
            h.update(len(part).to_bytes(4, "little"))
            h.update(torch.tensor(part, dtype=torch.int64).numpy().tobytes())
        h.update(repr(ex.margin).encode())
    return h.hexdigest()


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
                input_ids[row, P - p:P] = torch.tensor(ex.prompt_ids)
                input_ids[row, P:P + n] = torch.tensor(response)
                attention_mask[row, P - p:P + n] = 1
                response_mask[row, :n] = 1
        windows = {w for _, _, w in items}
        window = windows.pop() if len(windows) == 1 and None not in windows else B
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
        if truncation not in ("left", "drop", "error"):
            raise AlignDataError("data.truncation", None, None, "'left', 'drop' or 'error'", truncation)
        if identical_pairs not in ("drop", "keep", "error"):
            raise AlignDataError("data.identical_pairs", None, None, "'drop', 'keep' or 'error'", identical_pairs)
        check_val_size(val_size)
        self.save_hyperparameters()
        self.stats: dict[str, PreparedSplit] = {}

    def encoding_spec(self) -> dict:
        """What a scorer needs to encode text the way training did (saved with reward-model exports)."""
        hp = self.hparams
        return {"use_chat_template": self.encoder().use_chat_template, "system_prompt": hp.system_prompt,
                "max_length": hp.max_length, "max_prompt_length": hp.max_prompt_length}

    def load_examples(self, files: list[str], split: str | None, name: str, split_key: str) -> list[PreferenceExample]:
        hp = self.hparams
        encoder = self.encoder()
        total = PreparedSplit()
        for source in files:
            found = tokenize_preference_rows(
                read_rows(source, split, split_key), source, encoder, max_length=hp.max_length,
                max_prompt_length=hp.max_prompt_length, truncation=hp.truncation, identical_pairs=hp.identical_pairs,
                ignore_columns=frozenset(hp.ignore_columns or ()), system_prompt=hp.system_prompt, strict=hp.strict,
                unpaired=self.unpaired,
            )
            if found.identical:
                log.warning("%s: %d of %d rows have chosen == rejected (%s)", source, found.identical, found.rows,
                            "dropped" if found.dropped_identical else "kept")
            if found.truncated:
                log.warning("%s: truncated the prompt (from the left) of %d of %d rows to fit max_length=%d",
                            source, found.truncated, found.rows, hp.max_length)
            if found.dropped_long:
                log.warning("%s: dropped %d of %d rows longer than max_length=%d", source, found.dropped_long,
                            found.rows, hp.max_length)
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
        # Every pair weighs 1: the loss of an optimizer step is a mean over the pairs of its whole window.
        return self.window_dataloader(self.train_set, [1] * len(self.train_set), self.collator())

    def eval_dataloader(self, dataset: PreferenceDataset, batch_size: int | None = None) -> DataLoader:
        """In-order batches over ``dataset`` (validation, and reference precomputation)."""
        return DataLoader(dataset, batch_size=batch_size or self.hparams.val_batch_size or self.hparams.batch_size,
                          shuffle=False, collate_fn=self.collator(), num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
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
            raise AlignDataError(", ".join(files), None, "label", "both desirable (true) and undesirable (false) "
                                 "examples: KTO's loss needs each kind", f"only label {labels.pop()}")
        mismatch_completions(examples, self.hparams.seed, self.hparams.max_length)
        return examples

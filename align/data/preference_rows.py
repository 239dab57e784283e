"""Preference rows to tokenized examples: validation of each row, then tokenization with the chat template.

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
undesirable one) are read by :class:`~align.data.preference.UnpairedDataModule` only, which also reads the paired
shapes above and turns each pair into a desirable and an undesirable example. An optional ``margin`` column (a
number, the Llama 2 preference strength, arXiv 2307.09288) is used by the reward model's Bradley-Terry loss.

Tokenization applies the chat template once to the prompt plus each response (:class:`~align.data.chat.ChatEncoder`):
the prompt ids are the ids a rollout would generate from, and each response's ids are what the template adds after
them (the response text, its turn end and EOS). Chosen and rejected share the same prompt ids.

Handled explicitly, and counted (:class:`PreparedSplit`; the data module logs the counts per file):

* A prompt too long for ``max_length`` (or ``max_prompt_length``): ``truncation="left"`` keeps the prompt's last
  tokens and both full responses; ``"drop"`` skips the row; ``"error"`` stops with the file and row. A pair whose
  responses alone do not fit is dropped under ``"drop"`` and an error otherwise (responses are never cut).
* ``chosen == rejected``: a warning with the count; such a pair carries no preference, so it is dropped unless
  ``identical_pairs="keep"``.
* A missing or malformed field: :class:`~align.errors.AlignDataError` naming the file, row and field.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from align.data.chat import ChatEncoder
from align.data.formats import (
    UnusedColumns,
    check_messages,
    completion_text,
    conversation,
    detect_format,
    hh_messages,
    prompt_messages,
    row_system,
    with_system,
)
from align.data.io import numbered
from align.errors import AlignDataError

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


def preference_record(
    row: dict,
    source: str,
    index: int,
    ignore: frozenset = frozenset(),
    system_prompt: str | None = None,
    unused: UnusedColumns | None = None,
    unpaired: bool = False,
) -> PreferenceRecord:
    """Validate one row of any accepted shape; errors name the file, the row and the field. Unpaired rows are
    accepted only when ``unpaired`` (KTO's data)."""
    for name, other in (("chosen", "rejected"), ("rejected", "chosen")):
        if other in row and name not in row:
            raise AlignDataError(
                source,
                index,
                name,
                f"a '{name}' field beside '{other}' in every preference row "
                "({prompt, chosen, rejected} or {chosen, rejected})",
                f"fields {sorted(row)}",
            )
    fmt, extra = detect_format(row, PREFERENCE_FORMATS, source, index, ignore)
    if fmt == "unpaired preference" and not unpaired:
        raise AlignDataError(
            source,
            index,
            "label",
            "paired rows {prompt, chosen, rejected} or {chosen, rejected}: "
            "unpaired {prompt, completion, label} rows are KTO's data (align.modules.kto.KTOModule "
            "with align.data.preference.UnpairedDataModule)",
        )
    if unused is not None:
        unused.check(index, fmt, extra, PREFERENCE_FORMATS[fmt][0] | PREFERENCE_FORMATS[fmt][1])
    system = row_system(row, source, index, system_prompt)
    margin = row.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin != margin):
        raise AlignDataError(source, index, "margin", "a number", margin)
    if fmt == "unpaired preference":
        if not isinstance(row["label"], bool):
            raise AlignDataError(
                source, index, "label", "true (a desirable completion) or false (an undesirable one)", row["label"]
            )
        prompt = prompt_messages(row["prompt"], source, index, "prompt")
        completion = response_after(prompt, row["completion"], source, index, "completion")
        return PreferenceRecord(with_system(prompt, system), completion, None, None, index, source, row["label"])
    if fmt == "explicit-prompt preference":
        prompt = prompt_messages(row["prompt"], source, index, "prompt")
        chosen = response_after(prompt, row["chosen"], source, index, "chosen")
        rejected = response_after(prompt, row["rejected"], source, index, "rejected")
    else:
        if isinstance(row["chosen"], str) and hh_messages(row["chosen"], source, index, "chosen") is None:
            raise AlignDataError(
                source,
                index,
                "prompt",
                "a 'prompt' field when 'chosen' is plain text (without one, "
                "chosen and rejected are whole conversations: lists of messages, or Anthropic HH "
                "text)",
                f"fields {sorted(row)}",
            )
        prompt, chosen, rejected = shared_prompt(
            conversation(row["chosen"], source, index, "chosen"),
            conversation(row["rejected"], source, index, "rejected"),
            source,
            index,
        )
    return PreferenceRecord(
        with_system(prompt, system), chosen, rejected, None if margin is None else float(margin), index, source
    )


def response_after(prompt: list[dict], value, source: str, index: int, field: str) -> str:
    """A response given as text, as one assistant message, or as a whole conversation that starts with the
    prompt's messages (UltraFeedback) and continues with one assistant message."""
    if not isinstance(value, list) or len(value) <= 1:
        return completion_text(value, source, index, field)
    messages = check_messages(value, source, index, field, need_assistant=True)
    if messages[: len(prompt)] != prompt or len(messages) != len(prompt) + 1 or messages[-1]["role"] != "assistant":
        raise AlignDataError(
            source,
            index,
            field,
            "a string, one assistant message, or a conversation made of the "
            "prompt's messages followed by one assistant message",
            value,
        )
    return messages[-1]["content"]


def shared_prompt(chosen: list[dict], rejected: list[dict], source: str, index: int) -> tuple[list[dict], str, str]:
    """Implicit prompt: ``(prompt, chosen reply, rejected reply)`` from two conversations identical up to their
    final assistant messages."""
    for name, messages in (("chosen", chosen), ("rejected", rejected)):
        if messages[-1]["role"] != "assistant" or len(messages) < 2:
            raise AlignDataError(
                source,
                index,
                name,
                "a conversation of at least one prompt message followed by the "
                "assistant's reply (an implicit-prompt row ends with one assistant message)",
                f"{len(messages)} messages ending with a {messages[-1]['role']} message",
            )
    prompt = chosen[:-1]
    if rejected[:-1] != prompt:
        at = next(
            (i for i, (a, b) in enumerate(zip(prompt, rejected[:-1])) if a != b), min(len(prompt), len(rejected) - 1)
        )
        raise AlignDataError(
            source,
            index,
            "rejected",
            "the same messages as 'chosen' before the final assistant "
            f"message (the shared prompt); they differ at message {at}",
        )
    if prompt[-1]["role"] == "assistant":
        raise AlignDataError(
            source,
            index,
            "chosen",
            "a prompt (the shared messages) that does not end with an assistant message",
            prompt[-1],
        )
    return prompt, chosen[-1]["content"], rejected[-1]["content"]


def encode_response(
    encoder: ChatEncoder,
    prompt_ids: list[int],
    messages: list[dict],
    response: str,
    source: str = "<data>",
    row: int | None = None,
    name: str = "response",
    prompt_text: str | None = None,
) -> list[int]:
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
            raise AlignDataError(
                source,
                row,
                name,
                "a chat template whose rendering of prompt + response starts with "
                "the rendering of the prompt (with its generation prompt)",
            )
        ids = encoder._ids(full[len(prompt_text) :])
        return ids[: encoder.until_eos(ids)]  # a response ends at its first EOS, as a sampled one does
    ids, _ = encoder.encode(messages + [{"role": "assistant", "content": response}], source, row)
    if ids[: len(prompt_ids)] != prompt_ids or len(ids) == len(prompt_ids):
        raise AlignDataError(source, row, name, "a tokenization of prompt + response that starts with the prompt's")
    return ids[len(prompt_ids) :]


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
                raise AlignDataError(
                    source,
                    index,
                    "rejected",
                    "a response different from 'chosen' (or set data.identical_pairs to 'drop' or 'keep')",
                    record.rejected,
                )
            if identical_pairs == "drop":
                out.dropped_identical += 1
                continue
        prompt_ids, prompt_text = encode_prompt(encoder, record.prompt)
        if record.label is not None:
            responses = [("completion", record.chosen, record.label)]
        else:
            assert record.rejected is not None  # preference_record gives every pair (a row without a label) both
            responses = [("chosen", record.chosen, True), ("rejected", record.rejected, False)]
        ids = [
            encode_response(encoder, prompt_ids, record.prompt, text, source, index, name, prompt_text)
            for name, text, _ in responses
        ]
        longest = max(map(len, ids))
        keep = fit_prompt(prompt_ids, longest, max_length, max_prompt_length)
        truncated = keep < len(prompt_ids)
        if truncated:
            if truncation == "drop":
                out.dropped_long += 1
                continue
            if keep == 0 or truncation == "error":
                what = (
                    "responses of at most max_length - 1 tokens"
                    if keep == 0
                    else "a prompt that fits max_length/max_prompt_length (or set data.truncation to 'left' or 'drop')"
                )
                raise AlignDataError(
                    source,
                    index,
                    None,
                    f"{what} (max_length={max_length}, max_prompt_length={max_prompt_length})",
                    f"prompt {len(prompt_ids)} + response {longest} tokens",
                )
            prompt_ids = prompt_ids[len(prompt_ids) - keep :]
            out.truncated += 1
        if unpaired:
            out.examples += [
                PreferenceExample(prompt_ids, r, [], 0.0, index, truncated, label)
                for r, (_, _, label) in zip(ids, responses)
            ]
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

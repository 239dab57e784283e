"""Row shapes and their validation (every shape, with an example row, is in docs/data.md).

SFT rows: ``{"prompt","completion"}`` (strings or messages), ``{"messages": [...]}``, ShareGPT's
``{"conversations": [{"from","value"}, ...]}``, ``{"instruction","input","output"}`` or ``{"text"}``.
Preference rows (:mod:`align.data.preference`): ``{"prompt","chosen","rejected"}``, or ``{"chosen","rejected"}``
holding whole conversations that share their prompt. RL prompt rows: ``{"prompt", ...}``.

A row's shape is the one whose required fields it has; columns no shape uses are reported once per file
(:class:`UnusedColumns`), or refused under ``data.strict``. Every check names the file, the row and the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lightning.pytorch.utilities import rank_zero_info

from align.errors import AlignDataError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "function_call": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "function_response": "tool",
    "observation": "tool",
}
"""ShareGPT's ``from`` values (as written by FastChat, Axolotl and LLaMA-Factory) and the role each becomes."""


def notice(message: str) -> None:
    """One line for the user, on global rank 0 only, shown by Lightning's default logging."""
    rank_zero_info(message)


@dataclass
class SFTRecord:
    """A validated SFT row: a conversation, or raw text trained in full."""

    messages: list[dict] | None
    text: str | None
    row: int
    source: str


# format name -> (required fields, optional fields)
SFT_FORMATS: dict[str, tuple[frozenset, frozenset]] = {
    "prompt_completion": (frozenset({"prompt", "completion"}), frozenset({"system"})),
    "messages": (frozenset({"messages"}), frozenset({"system"})),
    "sharegpt": (frozenset({"conversations"}), frozenset({"system"})),
    "instruction": (frozenset({"instruction", "output"}), frozenset({"input", "system"})),
    "text": (frozenset({"text"}), frozenset()),
}


def _expect_str(value, source, row, field, *, allow_empty=False) -> str:
    if not isinstance(value, str):
        raise AlignDataError(source, row, field, "a string", f"{type(value).__name__} {value!r}")
    if not allow_empty and not value.strip():
        raise AlignDataError(source, row, field, "a non-empty string", value)
    return value


def check_messages(value, source: str, row: int, field: str, *, need_assistant: bool) -> list[dict]:
    """A conversation as ``{role, content}`` messages. ShareGPT's ``{from, value}`` keys are read too, ``from``
    mapped by :data:`SHAREGPT_ROLES`. Other keys are allowed only when null (a parquet or Arrow column of
    structs gives every message every key)."""
    if not isinstance(value, list) or not value:
        raise AlignDataError(source, row, field, "a non-empty list of {role, content} messages", value)
    messages = []
    for i, message in enumerate(value):
        where = f"{field}[{i}]"
        keys = {k for k, v in message.items() if v is not None} if isinstance(message, dict) else set()
        if keys == {"role", "content"}:
            role, text = message["role"], message["content"]
            if role not in ROLES:
                raise AlignDataError(source, row, f"{where}.role", f"one of {list(ROLES)}", role)
        elif keys == {"from", "value"}:
            role, text = SHAREGPT_ROLES.get(message["from"]), message["value"]
            if role is None:
                raise AlignDataError(source, row, f"{where}.from", f"one of {sorted(SHAREGPT_ROLES)}", message["from"])
        else:
            raise AlignDataError(
                source,
                row,
                where,
                "an object with exactly the keys 'role' and 'content' (or ShareGPT's 'from' and 'value')",
                message,
            )
        content_key = "content" if "role" in keys else "value"
        messages.append({"role": role, "content": _expect_str(text, source, row, f"{where}.{content_key}")})
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise AlignDataError(source, row, field, "at least one assistant message to train on", value)
    return messages


def with_system(messages: list[dict], system: str | None) -> list[dict]:
    """``messages`` with a leading system message when ``system`` is set and they have none."""
    if system is not None and messages[0]["role"] != "system":
        return [{"role": "system", "content": system}] + messages
    return messages


def prompt_messages(value, source: str, row: int, field: str = "prompt", system: str | None = None) -> list[dict]:
    """A prompt given as a string or as a list of messages, as messages."""
    if isinstance(value, list):
        messages = check_messages(value, source, row, field, need_assistant=False)
        if messages[-1]["role"] == "assistant":
            raise AlignDataError(source, row, field, "a prompt that does not end with an assistant message", value)
    else:
        messages = [{"role": "user", "content": _expect_str(value, source, row, field)}]
    return with_system(messages, system)


def completion_text(value, source: str, row: int, field: str) -> str:
    """A response given as a string, or as a single assistant message in a list."""
    if isinstance(value, list):
        messages = check_messages(value, source, row, field, need_assistant=True)
        if len(messages) != 1:
            raise AlignDataError(source, row, field, "a string or a list with exactly one assistant message", value)
        return messages[0]["content"]
    return _expect_str(value, source, row, field)


_HH_TURN = re.compile(r"\n\n(Human|Assistant):")


def hh_messages(text: str, source: str, row: int, field: str) -> list[dict] | None:
    """Anthropic HH's raw text (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``) as messages; None without its markers."""
    parts = _HH_TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        return None
    messages = []
    for i, (speaker, content) in enumerate(zip(parts[1::2], parts[2::2])):
        if not content.strip():
            raise AlignDataError(source, row, field, f"text after every '{speaker}:' marker (turn {i + 1} is empty)")
        messages.append({"role": "user" if speaker == "Human" else "assistant", "content": content.strip()})
    return messages


def conversation(value, source: str, row: int, field: str) -> list[dict]:
    """A whole conversation: a list of messages, or Anthropic HH text."""
    if isinstance(value, str):
        messages = hh_messages(value, source, row, field)
        if messages is None:
            raise AlignDataError(
                source,
                row,
                field,
                "a whole conversation (a list of {role, content} messages, or "
                "Anthropic HH text with '\\n\\nHuman:' and '\\n\\nAssistant:' turns) when the row "
                "has no 'prompt' field",
                value,
            )
        return messages
    return check_messages(value, source, row, field, need_assistant=True)


def detect_format(
    row: dict, formats: dict[str, tuple[frozenset, frozenset]], source: str, index: int, ignore: frozenset = frozenset()
) -> tuple[str, list[str]]:
    """The row's shape, and the columns it carries that the shape does not use (sorted).

    A shape whose required fields include another's wins over it (``{prompt, chosen, rejected}`` over
    ``{chosen, rejected}``); two shapes that both fit otherwise make the row ambiguous.
    """
    keys = set(row) - ignore
    matches = [name for name, (required, _) in formats.items() if required <= keys]
    matches = [m for m in matches if not any(formats[m][0] < formats[o][0] for o in matches)]
    if len(matches) != 1:
        shapes = " or ".join("{" + ", ".join(sorted(req)) + "}" for req, _ in formats.values())
        detail = (
            f"fields {sorted(keys)}" if not matches else f"fields that match several formats ({', '.join(matches)})"
        )
        raise AlignDataError(source, index, None, f"a row with the fields {shapes}", detail)
    required, optional = formats[matches[0]]
    return matches[0], sorted(keys - required - optional)


class UnusedColumns:
    """Columns of one file that its rows' shape does not use: one notice per file, or an error under ``strict``."""

    def __init__(self, source: str, strict: bool = False):
        self.source, self.strict = source, strict
        self.columns: dict[str, int] = {}  # column -> first row carrying it

    def check(self, row: int, fmt: str, unused: list[str], used: frozenset) -> None:
        if unused and self.strict:
            raise AlignDataError(
                self.source,
                row,
                unused[0],
                f"only the fields {sorted(used)} of the {fmt} format "
                "(data.strict is true; list columns to skip in data.ignore_columns)",
                f"extra fields {unused}",
            )
        for name in unused:
            self.columns.setdefault(name, row)

    def report(self) -> None:
        if self.columns:
            notice(
                f"{self.source}: columns {sorted(self.columns)} are not used and were ignored (set data.strict "
                "to refuse them, or list them in data.ignore_columns to silence this)"
            )


def row_system(row: dict, source: str, index: int, default: str | None) -> str | None:
    """The row's ``system`` column when it has a value, else ``default`` (``data.system_prompt``)."""
    if row.get("system") is None:
        return default
    return _expect_str(row["system"], source, index, "system")


def sft_record(
    row: dict,
    source: str,
    index: int,
    ignore: frozenset = frozenset(),
    system_prompt: str | None = None,
    unused: UnusedColumns | None = None,
) -> SFTRecord:
    fmt, extra = detect_format(row, SFT_FORMATS, source, index, ignore)
    if unused is not None:
        unused.check(index, fmt, extra, SFT_FORMATS[fmt][0] | SFT_FORMATS[fmt][1])
    system = row_system(row, source, index, system_prompt)
    if fmt == "text":
        return SFTRecord(None, _expect_str(row["text"], source, index, "text"), index, source)
    if fmt in ("messages", "sharegpt"):
        field = "messages" if fmt == "messages" else "conversations"
        messages = check_messages(row[field], source, index, field, need_assistant=True)
        return SFTRecord(with_system(messages, system), None, index, source)
    if fmt == "instruction":
        instruction = _expect_str(row["instruction"], source, index, "instruction")
        extra_input = _expect_str(row.get("input") or "", source, index, "input", allow_empty=True)
        prompt = instruction + ("\n\n" + extra_input if extra_input.strip() else "")
        messages = prompt_messages(prompt, source, index, "instruction", system)
        return SFTRecord(
            messages + [{"role": "assistant", "content": _expect_str(row["output"], source, index, "output")}],
            None,
            index,
            source,
        )
    messages = prompt_messages(row["prompt"], source, index, "prompt", system)
    completion = completion_text(row["completion"], source, index, "completion")
    return SFTRecord(messages + [{"role": "assistant", "content": completion}], None, index, source)

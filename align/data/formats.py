"""Row formats and their validation.

SFT rows take one of four shapes (README, "Data formats"): ``{"prompt","completion"}``, ``{"messages": [...]}``,
``{"instruction","input","output"}`` or ``{"text"}``. Preference rows are ``{"prompt","chosen","rejected"}``,
each a string or a list of messages. RL prompt rows are ``{"prompt", ...}`` with any extra columns.
Every check names the file, the row and the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from align.errors import AlignDataError

ROLES = ("system", "user", "assistant", "tool")


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
    "messages": (frozenset({"messages"}), frozenset()),
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
    if not isinstance(value, list) or not value:
        raise AlignDataError(source, row, field, "a non-empty list of {role, content} messages", value)
    messages = []
    for i, message in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(message, dict) or set(message) - {"role", "content"} or "role" not in message or "content" not in message:
            raise AlignDataError(source, row, where, "an object with exactly the keys 'role' and 'content'", message)
        if message["role"] not in ROLES:
            raise AlignDataError(source, row, f"{where}.role", f"one of {list(ROLES)}", message["role"])
        messages.append({"role": message["role"], "content": _expect_str(message["content"], source, row, f"{where}.content")})
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise AlignDataError(source, row, field, "at least one assistant message to train on", value)
    return messages


def prompt_messages(value, source: str, row: int, field: str = "prompt", system: str | None = None) -> list[dict]:
    """A prompt given as a string or as a list of messages, as messages."""
    if isinstance(value, list):
        messages = check_messages(value, source, row, field, need_assistant=False)
        if messages[-1]["role"] == "assistant":
            raise AlignDataError(source, row, field, "a prompt that does not end with an assistant message", value)
    else:
        messages = [{"role": "user", "content": _expect_str(value, source, row, field)}]
    if system is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}] + messages
    return messages


def completion_text(value, source: str, row: int, field: str) -> str:
    """A response given as a string, or as a single assistant message in a list."""
    if isinstance(value, list):
        messages = check_messages(value, source, row, field, need_assistant=True)
        if len(messages) != 1:
            raise AlignDataError(source, row, field, "a string or a list with exactly one assistant message", value)
        return messages[0]["content"]
    return _expect_str(value, source, row, field)


def detect_format(row: dict, formats: dict[str, tuple[frozenset, frozenset]], source: str, index: int, ignore: frozenset) -> str:
    keys = set(row) - ignore
    matches = [name for name, (required, _) in formats.items() if required <= keys]
    if len(matches) != 1:
        shapes = " or ".join("{" + ", ".join(sorted(req)) + "}" for req, _ in formats.values())
        detail = f"fields {sorted(keys)}" if not matches else f"fields that match several formats ({', '.join(matches)})"
        raise AlignDataError(source, index, None, f"a row with the fields {shapes}", detail)
    required, optional = formats[matches[0]]
    extra = keys - required - optional
    if extra:
        raise AlignDataError(
            source, index, sorted(extra)[0],
            f"only the fields {sorted(required | optional)} for the {matches[0]} format "
            "(list columns to skip in data.ignore_columns)",
            f"extra fields {sorted(extra)}",
        )
    return matches[0]


def sft_record(row: dict, source: str, index: int, ignore: frozenset = frozenset(), system_prompt: str | None = None) -> SFTRecord:
    fmt = detect_format(row, SFT_FORMATS, source, index, ignore)
    system = row.get("system", system_prompt)
    if system is not None:
        system = _expect_str(system, source, index, "system")
    if fmt == "text":
        return SFTRecord(None, _expect_str(row["text"], source, index, "text"), index, source)
    if fmt == "messages":
        messages = check_messages(row["messages"], source, index, "messages", need_assistant=True)
        if system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}] + messages
        return SFTRecord(messages, None, index, source)
    if fmt == "instruction":
        instruction = _expect_str(row["instruction"], source, index, "instruction")
        extra_input = _expect_str(row.get("input", ""), source, index, "input", allow_empty=True)
        prompt = instruction + ("\n\n" + extra_input if extra_input.strip() else "")
        messages = prompt_messages(prompt, source, index, "instruction", system)
        return SFTRecord(messages + [{"role": "assistant", "content": _expect_str(row["output"], source, index, "output")}], None, index, source)
    messages = prompt_messages(row["prompt"], source, index, "prompt", system)
    completion = completion_text(row["completion"], source, index, "completion")
    return SFTRecord(messages + [{"role": "assistant", "content": completion}], None, index, source)

"""SFT row shapes users bring from Hugging Face (``align.data.formats``): each is pinned to the messages it becomes
(the preference shapes are in test_preference_rows.py)."""

import logging

import pytest

from align.data.formats import UnusedColumns, sft_record
from align.errors import AlignDataError

U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731
S = lambda text: {"role": "system", "content": text}  # noqa: E731


@pytest.mark.parametrize(
    "row, messages",
    [
        ({"prompt": "sort: b a", "completion": "a b"}, [U("sort: b a"), A("a b")]),
        ({"prompt": [U("sort: b a")], "completion": [A("a b")]}, [U("sort: b a"), A("a b")]),
        ({"messages": [S("be brief"), U("sort: b a"), A("a b")]}, [S("be brief"), U("sort: b a"), A("a b")]),
        ({"instruction": "Sort.", "input": "b a", "output": "a b"}, [U("Sort.\n\nb a"), A("a b")]),
        ({"instruction": "Sort b a.", "input": None, "output": "a b"}, [U("Sort b a."), A("a b")]),
        (
            {
                "conversations": [
                    {"from": "system", "value": "be brief"},
                    {"from": "human", "value": "sort: b a"},
                    {"from": "gpt", "value": "a b"},
                    {"from": "user", "value": "sort: d c"},
                    {"from": "chatgpt", "value": "c d"},
                ]
            },
            [S("be brief"), U("sort: b a"), A("a b"), U("sort: d c"), A("c d")],
        ),
        (
            {
                "conversations": [
                    {"from": "human", "value": "weather?"},
                    {"from": "function_call", "value": "{}"},
                    {"from": "observation", "value": "sunny"},
                    {"from": "gpt", "value": "Sunny."},
                ]
            },
            [U("weather?"), A("{}"), {"role": "tool", "content": "sunny"}, A("Sunny.")],
        ),
        (
            {"conversations": [U("sort: b a"), A("a b")], "system": "be brief"},
            [S("be brief"), U("sort: b a"), A("a b")],
        ),
        # a parquet/Arrow struct column gives every message every key; null ones are not there
        (
            {
                "messages": [
                    {"role": "user", "content": "hi", "tool_calls": None},
                    {"role": "assistant", "content": "yo", "tool_calls": None},
                ]
            },
            [U("hi"), A("yo")],
        ),
    ],
)
def test_sft_shapes_become_these_messages(row, messages):
    assert sft_record(row, "d.jsonl", 1).messages == messages


@pytest.mark.parametrize(
    "row, field, expected",
    [
        (
            {"conversations": [{"from": "human", "value": "x"}, {"from": "bot", "value": "y"}]},
            "conversations[1].from",
            "one of",
        ),
        (
            {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": ""}]},
            "conversations[1].value",
            "non-empty",
        ),
        ({"conversations": [{"from": "human", "value": "x"}]}, "conversations", "at least one assistant message"),
        ({"conversations": [{"from": "human", "content": "x"}]}, "conversations[0]", "'from' and 'value'"),
    ],
)
def test_sharegpt_errors_name_the_message_and_key(row, field, expected):
    with pytest.raises(AlignDataError) as info:
        sft_record(row, "d.jsonl", 4)
    assert str(info.value).startswith(f"d.jsonl: row 4: field '{field}': expected") and expected in str(info.value)


def test_unused_columns_one_notice_per_file_or_an_error_when_strict(caplog):
    rows = [{"prompt": "a", "completion": "b", "id": 1}, {"prompt": "c", "completion": "d", "id": 2, "lang": "en"}]
    unused = UnusedColumns("d.jsonl")
    with caplog.at_level(logging.INFO):
        for i, row in enumerate(rows, start=1):
            sft_record(row, "d.jsonl", i, unused=unused)
        unused.report()
    lines = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert lines == [
        "d.jsonl: columns ['id', 'lang'] are not used and were ignored (set data.strict to refuse "
        "them, or list them in data.ignore_columns to silence this)"
    ]
    caplog.clear()
    ignored = UnusedColumns("d.jsonl")
    with caplog.at_level(logging.INFO):
        sft_record(rows[1], "d.jsonl", 1, ignore=frozenset({"id", "lang"}), unused=ignored)
        ignored.report()
    assert not [r for r in caplog.records if "not used" in r.getMessage()]
    with pytest.raises(
        AlignDataError,
        match=r"^d.jsonl: row 1: field 'id': expected only the fields "
        r"\['completion', 'prompt', 'system'\] .*data.strict is true",
    ):
        sft_record(rows[0], "d.jsonl", 1, unused=UnusedColumns("d.jsonl", strict=True))


def test_a_row_that_fits_two_shapes_is_ambiguous():
    with pytest.raises(AlignDataError, match="row 2: expected a row with the fields .* several formats"):
        sft_record({"prompt": "a", "completion": "b", "text": "c"}, "d.jsonl", 2)

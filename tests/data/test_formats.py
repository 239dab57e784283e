"""Row shapes users bring from Hugging Face: each is pinned to the messages it becomes."""

import logging

import pytest

from align.data.formats import UnusedColumns, sft_record
from align.data.preference_rows import preference_record
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


HH_CHOSEN = "\n\nHuman: sort: b a\n\nAssistant: b a?\n\nHuman: sorted, please\n\nAssistant: a b"
HH_REJECTED = "\n\nHuman: sort: b a\n\nAssistant: b a?\n\nHuman: sorted, please\n\nAssistant: b a"


@pytest.mark.parametrize(
    "row, prompt, chosen, rejected",
    [
        ({"prompt": "sort: b a", "chosen": "a b", "rejected": "b a"}, [U("sort: b a")], "a b", "b a"),
        ({"prompt": [U("sort: b a")], "chosen": [A("a b")], "rejected": [A("b a")]}, [U("sort: b a")], "a b", "b a"),
        # implicit prompt: two whole conversations sharing everything but the final assistant message
        (
            {
                "chosen": [S("be brief"), U("sort: b a"), A("a b")],
                "rejected": [S("be brief"), U("sort: b a"), A("b a")],
            },
            [S("be brief"), U("sort: b a")],
            "a b",
            "b a",
        ),
        # UltraFeedback: the prompt as text, and whole conversations starting with it
        (
            {
                "prompt": "sort: b a",
                "chosen": [U("sort: b a"), A("a b")],
                "rejected": [U("sort: b a"), A("b a")],
                "messages": [U("sort: b a"), A("a b")],
                "score_chosen": 8.0,
                "score_rejected": 2.0,
            },
            [U("sort: b a")],
            "a b",
            "b a",
        ),
        # Anthropic HH raw text
        (
            {"chosen": HH_CHOSEN, "rejected": HH_REJECTED},
            [U("sort: b a"), A("b a?"), U("sorted, please")],
            "a b",
            "b a",
        ),
    ],
)
def test_preference_shapes_become_prompt_and_two_responses(row, prompt, chosen, rejected):
    record = preference_record(row, "p.jsonl", 1)
    assert (record.prompt, record.chosen, record.rejected) == (prompt, chosen, rejected)


def test_system_prompt_goes_before_an_implicit_prompt_without_one():
    row = {"chosen": [U("hi"), A("yo")], "rejected": [U("hi"), A("no")]}
    assert preference_record(row, "p.jsonl", 1, system_prompt="be kind").prompt == [S("be kind"), U("hi")]


@pytest.mark.parametrize(
    "row, field, expected",
    [
        (
            {"chosen": [U("sort: b a"), A("a b")], "rejected": [U("sort: c a"), A("a c")]},
            "rejected",
            "the same messages as 'chosen' before the final assistant message",
        ),
        (
            {"chosen": [U("sort: b a"), A("a b"), U("more")], "rejected": [U("sort: b a"), A("b a")]},
            "chosen",
            "ends with one assistant message",
        ),
        ({"chosen": [A("a b")], "rejected": [A("b a")]}, "chosen", "at least one prompt message"),
        ({"chosen": "\n\nHuman: hi\n\nAssistant: ", "rejected": HH_REJECTED}, "chosen", "turn 2 is empty"),
        ({"chosen": "a b", "rejected": "b a"}, "prompt", "a 'prompt' field"),
        (
            {"prompt": "sort: b a", "chosen": [U("sort: c a"), A("a c")], "rejected": "b a"},
            "chosen",
            "the prompt's messages followed by one assistant message",
        ),
        ({"prompt": "sort: b a", "completion": "a b", "label": True}, "label", "rows are KTO's data"),
    ],
)
def test_preference_shape_errors_name_file_row_and_field(row, field, expected):
    with pytest.raises(AlignDataError) as info:
        preference_record(row, "p.jsonl", 7)
    assert str(info.value).startswith(f"p.jsonl: row 7: field '{field}': expected") and expected in str(info.value)


@pytest.mark.parametrize(
    "row, field, expected",
    [
        (
            {"prompt": "sort: b a", "completion": "a b", "label": "yes"},
            "label",
            "true (a desirable completion) or false",
        ),
        ({"prompt": "sort: b a", "completion": "a b", "label": 1}, "label", "true (a desirable completion) or false"),
        ({"prompt": "sort: b a", "completion": "", "label": True}, "completion", "a non-empty string"),
        ({"prompt": "sort: b a", "label": True}, None, "{completion, label, prompt}"),
    ],
)
def test_unpaired_shape_errors_name_file_row_and_field(row, field, expected):
    with pytest.raises(AlignDataError) as info:
        preference_record(row, "u.jsonl", 3, unpaired=True)
    where = "u.jsonl: row 3: " + (f"field '{field}': " if field else "")
    assert str(info.value).startswith(where + "expected") and expected in str(info.value)


def test_unpaired_rows_take_text_or_messages():
    plain = preference_record({"prompt": "hi", "completion": "yo", "label": False}, "u.jsonl", 1, unpaired=True)
    chat = preference_record(
        {"prompt": [U("hi")], "completion": [A("yo")], "label": False}, "u.jsonl", 1, unpaired=True
    )
    for record in (plain, chat):
        assert (record.prompt, record.chosen, record.rejected, record.label) == ([U("hi")], "yo", None, False)


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

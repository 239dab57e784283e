"""Preference rows (``align.data.preference_rows``): the shapes users bring from Hugging Face, each pinned to the prompt
and two responses it becomes, and their tokenization (the chat template, truncation, identical pairs, unpaired
examples, the fingerprint of a tokenized split)."""

import pytest

from align.data.chat import ChatEncoder
from align.data.preference import PreferenceDataModule
from align.data.preference_rows import fingerprint_examples, preference_record, tokenize_preference_rows
from align.errors import AlignDataError
from align.hub.tiny import load_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


def tokenize(encoder, rows, **kwargs):
    kwargs.setdefault("max_length", 64)
    return tokenize_preference_rows(rows, "pairs.jsonl", encoder, **kwargs)


U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731
S = lambda text: {"role": "system", "content": text}  # noqa: E731


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


def test_template_applied_once_prompt_plus_each_response(encoder, tokenizer):
    row = {"prompt": "sort: c a b", "chosen": "a b c", "rejected": "c a b"}
    ex = tokenize(encoder, [row]).examples[0]
    messages = [{"role": "user", "content": row["prompt"]}]
    for response, ids in ((row["chosen"], ex.chosen_ids), (row["rejected"], ex.rejected_ids)):
        full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
        assert tokenizer.decode(ex.prompt_ids + ids) == full
        assert full.count(tokenizer.bos_token) == 1
        assert ids[-1] == tokenizer.eos_token_id
    assert ex.prompt_ids == encoder.prompt_ids(messages)


def test_messages_fields_equal_string_fields(encoder):
    plain = {"prompt": "sort: c a b", "chosen": "a b c", "rejected": "c a b"}
    chat = {
        "prompt": [{"role": "user", "content": "sort: c a b"}],
        "chosen": [{"role": "assistant", "content": "a b c"}],
        "rejected": [{"role": "assistant", "content": "c a b"}],
    }
    a, b = tokenize(encoder, [plain]).examples[0], tokenize(encoder, [chat]).examples[0]
    assert (a.prompt_ids, a.chosen_ids, a.rejected_ids) == (b.prompt_ids, b.chosen_ids, b.rejected_ids)


@pytest.mark.parametrize(
    "row, field, expected",
    [
        ({"prompt": "p", "chosen": "a"}, "rejected", "a 'rejected' field"),
        ({"chosen": "a", "rejected": "b"}, "prompt", "a 'prompt' field"),
        ({"prompt": "p", "chosen": "", "rejected": "b"}, "chosen", "a non-empty string"),
        ({"prompt": "p", "chosen": 3, "rejected": "b"}, "chosen", "a string"),
        (
            {"prompt": "p", "chosen": "a", "rejected": [{"role": "user", "content": "x"}]},
            "rejected",
            "at least one assistant message",
        ),
        ({"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"}, "prompt[0]", "exactly the keys"),
        ({"prompt": "p", "chosen": "a", "rejected": "b", "score": 1}, "score", "only the fields"),
        ({"prompt": "p", "chosen": "a", "rejected": "b", "margin": "big"}, "margin", "a number"),
    ],
)
def test_bad_rows_name_file_row_and_field(encoder, row, field, expected):
    good = {"prompt": "sort: b a", "chosen": "a b", "rejected": "b a"}
    with pytest.raises(AlignDataError) as info:
        tokenize(encoder, [good, good, row], strict=True)
    message = str(info.value)
    assert "pairs.jsonl: row 3" in message and f"field '{field}'" in message and expected in message


def test_identical_pairs_are_counted_and_dropped_kept_or_rejected(encoder):
    rows = [
        {"prompt": "sort: b a", "chosen": "a b", "rejected": "a b"},
        {"prompt": "sort: b a", "chosen": "a b", "rejected": "b a"},
    ]
    dropped = tokenize(encoder, rows)
    assert (dropped.identical, dropped.dropped_identical, len(dropped.examples)) == (1, 1, 1)
    kept = tokenize(encoder, rows, identical_pairs="keep")
    assert (kept.identical, kept.dropped_identical, len(kept.examples)) == (1, 0, 2)
    with pytest.raises(AlignDataError, match="row 1: field 'rejected'"):
        tokenize(encoder, rows, identical_pairs="error")


def test_long_prompts_truncate_left_drop_or_error(encoder):
    long_prompt = "sort: " + " ".join("abcdefghij" * 4)
    rows = [
        {"prompt": long_prompt, "chosen": "a b", "rejected": "b a"},
        {"prompt": "sort: b a", "chosen": "a b", "rejected": "b a"},
    ]
    full = tokenize(encoder, rows, max_length=512).examples[0]
    cut = tokenize(encoder, rows, max_length=32)
    ex = cut.examples[0]
    assert cut.truncated == 1 and ex.truncated and len(cut.examples) == 2
    assert ex.chosen_ids == full.chosen_ids and ex.rejected_ids == full.rejected_ids  # responses kept whole
    assert ex.prompt_ids == full.prompt_ids[-len(ex.prompt_ids) :]  # the prompt's end is kept
    assert len(ex.prompt_ids) + max(len(ex.chosen_ids), len(ex.rejected_ids)) == 32
    capped = tokenize(encoder, rows, max_length=512, max_prompt_length=10).examples[0]
    assert capped.prompt_ids == full.prompt_ids[-10:]
    dropped = tokenize(encoder, rows, max_length=32, truncation="drop")
    assert dropped.dropped_long == 1 and len(dropped.examples) == 1 and dropped.examples[0].row == 2
    with pytest.raises(AlignDataError, match="row 1: expected a prompt that fits"):
        tokenize(encoder, rows, max_length=32, truncation="error")
    with pytest.raises(AlignDataError, match="row 1: expected responses of at most"):
        tokenize(encoder, rows[1:], max_length=3)


def test_fingerprint_changes_with_tokens_and_margin(encoder):
    rows = [{"prompt": "sort: b a", "chosen": "a b", "rejected": "b a"}]
    base = tokenize(encoder, rows).examples
    assert fingerprint_examples(base) == fingerprint_examples(tokenize(encoder, rows).examples)
    other = tokenize(encoder, [dict(rows[0], rejected="b a a")]).examples
    margin = tokenize(encoder, [dict(rows[0], margin=1.5)]).examples
    assert len({fingerprint_examples(base), fingerprint_examples(other), fingerprint_examples(margin)}) == 3


def test_every_preference_shape_of_one_pair_tokenizes_to_the_same_ids(encoder, tmp_path):
    """Explicit, implicit, UltraFeedback and HH text are one multi-turn pair: identical prompt and response ids."""
    turns = [
        {"role": "user", "content": "sort: b a"},
        {"role": "assistant", "content": "b a?"},
        {"role": "user", "content": "sorted, please"},
    ]
    reply = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    hh = "\n\nHuman: sort: b a\n\nAssistant: b a?\n\nHuman: sorted, please\n\nAssistant: "
    rows = [
        {"prompt": turns, "chosen": "a b", "rejected": "b a"},
        {"chosen": turns + reply("a b"), "rejected": turns + reply("b a")},
        {"prompt": turns, "chosen": turns + reply("a b"), "rejected": turns + reply("b a")},
        {"chosen": hh + "a b", "rejected": hh + "b a"},
    ]
    examples = tokenize(encoder, rows).examples
    assert len(examples) == 4
    first = examples[0]
    assert encoder.tokenizer.decode(first.prompt_ids).count("sorted, please") == 1
    for ex in examples[1:]:
        assert (ex.prompt_ids, ex.chosen_ids, ex.rejected_ids) == (
            first.prompt_ids,
            first.chosen_ids,
            first.rejected_ids,
        )

    import datasets

    datasets.Dataset.from_list(rows[1:2] * 3).save_to_disk(str(tmp_path / "pairs"))
    dm = PreferenceDataModule(train_files=str(tmp_path / "pairs"), val_files=None, max_length=64)
    dm.set_tokenizer(encoder.tokenizer)
    dm.setup("fit")
    assert [(e.prompt_ids, e.chosen_ids) for e in dm.train_set.examples] == [(first.prompt_ids, first.chosen_ids)] * 3


def test_pairs_become_a_desirable_and_an_undesirable_example_sharing_the_prompt(encoder):
    pair = {"prompt": "sort: c a b", "chosen": "a b c", "rejected": "c a b"}
    unpaired = [
        {"prompt": "sort: c a b", "completion": "a b c", "label": True},
        {"prompt": "sort: c a b", "completion": "c a b", "label": False},
    ]
    (ex,) = tokenize(encoder, [pair]).examples
    desirable, undesirable = tokenize(encoder, [pair], unpaired=True).examples
    assert (desirable.label, undesirable.label) == (True, False)
    assert desirable.prompt_ids == undesirable.prompt_ids == ex.prompt_ids
    assert (desirable.chosen_ids, undesirable.chosen_ids) == (ex.chosen_ids, ex.rejected_ids)
    from_rows = tokenize(encoder, unpaired, unpaired=True).examples
    assert [(e.prompt_ids, e.chosen_ids, e.label) for e in from_rows] == [
        (e.prompt_ids, e.chosen_ids, e.label) for e in (desirable, undesirable)
    ]
    with pytest.raises(AlignDataError, match="KTO's data"):
        tokenize(encoder, unpaired)

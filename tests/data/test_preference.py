import json
import logging

import pytest
import torch

from align.data.chat import ChatEncoder
from align.data.preference import PreferenceCollator, PreferenceDataModule, UnpairedDataModule
from align.data.preference_rows import fingerprint_examples, tokenize_preference_rows
from align.errors import AlignConfigError, AlignDataError
from align.hub.tiny import load_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer)


def write(tmp_path, rows, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tokenize(encoder, rows, **kwargs):
    kwargs.setdefault("max_length", 64)
    return tokenize_preference_rows(rows, "pairs.jsonl", encoder, **kwargs)


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


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(truncation="right"), r"^data\.truncation: expected 'left', 'drop' or 'error', got 'right'$"),
        (dict(identical_pairs="skip"), r"^data\.identical_pairs: expected 'drop', 'keep' or 'error', got 'skip'$"),
    ],
)
def test_unknown_policies_fail_naming_the_setting(settings, message):
    for module in (PreferenceDataModule, UnpairedDataModule):
        with pytest.raises(AlignConfigError, match=message):
            module(**settings)


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


def test_collator_layout_and_shapes(encoder, tokenizer):
    rows = [
        {"prompt": "sort: c a b d e", "chosen": "a b c d e", "rejected": "a b"},
        {"prompt": "sort: b a", "chosen": "a b", "rejected": "b a a a"},
    ]
    examples = tokenize(encoder, rows).examples
    batch = PreferenceCollator(tokenizer.pad_token_id)([(i, ex, None) for i, ex in enumerate(examples)])
    B, P = 2, max(len(ex.prompt_ids) for ex in examples)
    R = max(len(x) for ex in examples for x in (ex.chosen_ids, ex.rejected_ids))
    assert batch.input_ids.shape == (2 * B, P + R) and batch.attention_mask.shape == (2 * B, P + R)
    assert batch.response_mask.shape == (2 * B, R) and batch.response_length == R
    assert batch.num_pairs == B and batch.margin.shape == (B,) and batch.index.tolist() == [0, 1]
    assert float(batch.window_pairs) == B
    for b, ex in enumerate(examples):
        for row, response in ((b, ex.chosen_ids), (B + b, ex.rejected_ids)):
            real = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
            assert real == ex.prompt_ids + response
            assert batch.input_ids[row, P:][batch.response_mask[row].bool()].tolist() == response
            assert batch.attention_mask[row, :P].tolist() == [0] * (P - len(ex.prompt_ids)) + [1] * len(ex.prompt_ids)
    assert batch.num_tokens == int(batch.attention_mask.sum())


def test_fingerprint_changes_with_tokens_and_margin(encoder):
    rows = [{"prompt": "sort: b a", "chosen": "a b", "rejected": "b a"}]
    base = tokenize(encoder, rows).examples
    assert fingerprint_examples(base) == fingerprint_examples(tokenize(encoder, rows).examples)
    other = tokenize(encoder, [dict(rows[0], rejected="b a a")]).examples
    margin = tokenize(encoder, [dict(rows[0], margin=1.5)]).examples
    assert len({fingerprint_examples(base), fingerprint_examples(other), fingerprint_examples(margin)}) == 3


def test_datamodule_windows_count_pairs_and_warns(tmp_path, tokenizer, caplog):
    rows = [{"prompt": f"sort: {'b a ' * (i + 1)}".strip(), "chosen": "a b", "rejected": "b a"} for i in range(7)]
    rows.append({"prompt": "sort: a", "chosen": "a", "rejected": "a"})
    path = write(tmp_path, rows)
    dm = PreferenceDataModule(train_files=path, val_files=path, batch_size=2, max_length=64)
    dm.set_tokenizer(tokenizer)
    with caplog.at_level(logging.WARNING):
        dm.setup("fit")
    assert "1 of 8 rows have chosen == rejected" in caplog.text
    assert dm.stats["train"].identical == 1 and len(dm.train_set) == 7

    class FakeTrainer:
        accumulate_grad_batches = 2

    dm.trainer = FakeTrainer()
    batches = list(dm.train_dataloader())
    assert [b.num_pairs for b in batches] == [2, 2, 2, 1]
    assert [float(b.window_pairs) for b in batches] == [4, 4, 3, 3]
    assert sorted(torch.cat([b.index for b in batches]).tolist()) == list(range(7))


def test_bundled_preference_data_loads_cleanly(tokenizer):
    dm = PreferenceDataModule(batch_size=4, max_length=64)
    dm.set_tokenizer(tokenizer)
    dm.setup("fit")
    for split in ("train", "val"):
        stats = dm.stats[split]
        assert (
            stats.truncated == stats.dropped_long == 0 and len(stats.examples) == stats.rows - stats.dropped_identical
        )


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


# ---------------------------------------------------------------- unpaired (KTO)


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


def test_unpaired_module_pairs_each_example_with_another_completion(tmp_path, tokenizer):
    rows = [
        {"prompt": f"sort: {a} {b}", "completion": f"{b} {a}" if i % 3 else f"{a} {b}", "label": i % 3 > 0}
        for i, (a, b) in enumerate(zip("abcdefgh", "ijklmnop"))
    ]
    dm = UnpairedDataModule(
        train_files=write(tmp_path, rows), val_files=None, max_length=64, batch_size=8, shuffle=False
    )
    dm.set_tokenizer(tokenizer)
    dm.setup("fit")
    examples = dm.train_set.examples
    completions = [ex.chosen_ids for ex in examples]
    # each example's KL completion is another example's completion, each used once
    assert sorted(map(tuple, (ex.rejected_ids for ex in examples))) == sorted(map(tuple, completions))
    assert all(ex.rejected_ids != ex.chosen_ids for ex in examples)
    batch = next(iter(dm.eval_dataloader(dm.train_set)))
    assert batch.label.tolist() == [r["label"] for r in rows] and batch.num_pairs == 8
    for b, ex in enumerate(examples):
        n, kl = len(ex.chosen_ids), len(ex.rejected_ids)
        R = batch.response_length
        assert batch.input_ids[b, -R:][:n].tolist() == ex.chosen_ids
        assert batch.input_ids[8 + b, -R:][:kl].tolist() == ex.rejected_ids
        assert batch.response_mask[8 + b].sum() == kl


def test_unpaired_data_with_one_label_fails_naming_the_file(tmp_path, tokenizer):
    rows = [{"prompt": "sort: b a", "completion": "a b", "label": True}] * 3
    dm = UnpairedDataModule(train_files=write(tmp_path, rows, "good.jsonl"), val_files=None)
    dm.set_tokenizer(tokenizer)
    with pytest.raises(AlignDataError) as info:
        dm.setup("fit")
    assert str(info.value) == (
        f"{tmp_path}/good.jsonl: field 'label': expected both desirable (true) and "
        "undesirable (false) examples: KTO's loss needs each kind, got 'only label True'"
    )

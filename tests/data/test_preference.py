import json
import logging

import pytest
import torch

from align.data.chat import ChatEncoder
from align.data.preference import PreferenceCollator, PreferenceDataModule, UnpairedDataModule
from align.data.preference_rows import tokenize_preference_rows
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


# ---------------------------------------------------------------- unpaired (KTO)


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

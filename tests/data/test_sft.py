import json

import pytest
import torch

from align.data.chat import IGNORE_INDEX, ChatEncoder
from align.data.io import read_rows
from align.data.sft import SFTCollator, SFTDataModule, pack, tokenize_rows
from align.errors import AlignConfigError, AlignDataError
from align.hub.tiny import build_tiny_model, load_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tiny_tokenizer()


@pytest.fixture(scope="module")
def tok_pe():
    return load_tiny_tokenizer(pad_equals_eos=True)


def trained(ids, labels):
    return [i for i, line in zip(ids, labels) if line != IGNORE_INDEX]


def test_prompt_completion_labels_cover_completion_and_eos_only(tok):
    enc = ChatEncoder(tok)
    messages = [{"role": "user", "content": "sort: c a b"}, {"role": "assistant", "content": "a b c"}]
    ids, labels = enc.encode(messages)
    prompt = enc.prompt_ids(messages[:1])
    assert ids[: len(prompt)] == prompt  # the generation prompt is an exact token prefix
    assert all(line == IGNORE_INDEX for line in labels[: len(prompt)])
    assert trained(ids, labels) == tok("a b c", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


def test_multi_turn_trains_every_assistant_turn_and_nothing_else(tok):
    enc = ChatEncoder(tok)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "sort: b a"},
        {"role": "assistant", "content": "a b"},
        {"role": "user", "content": "sort: d c"},
        {"role": "assistant", "content": "c d"},
    ]
    ids, labels = enc.encode(messages)
    expected = []
    for answer in ("a b", "c d"):
        expected += tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert trained(ids, labels) == expected
    text = tok.decode(ids)
    assert text.count("be brief") == 1 and ids.count(tok.bos_token_id) == 1
    assert ids == tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]


def test_formats_instruction_text_and_whole_sequence(tok):
    enc = ChatEncoder(tok)
    rows = [
        {"instruction": "sort the letters", "input": "b a", "output": "a b"},
        {"text": "plain text is trained in full"},
        {"prompt": "sort: b a", "completion": "a b"},
    ]
    examples, dropped = tokenize_rows(rows, "mem", enc, max_length=64)
    assert dropped == 0 and len(examples) == 3
    inst, text, pc = examples
    assert "sort the letters\n\nb a" in tok.decode(inst.input_ids)
    assert text.labels == text.input_ids and text.input_ids[-1] == tok.eos_token_id
    full, _ = tokenize_rows(rows[2:], "mem", enc, max_length=64, completion_only=False)
    assert full[0].labels == full[0].input_ids and pc.loss_tokens < full[0].loss_tokens


def test_pad_equals_eos_collation_keeps_the_eos_label(tok_pe):
    enc = ChatEncoder(tok_pe)
    rows = [{"prompt": "sort: b a", "completion": "a b"}, {"prompt": "sort: d c b a e", "completion": "a b c d e"}]
    examples, _ = tokenize_rows(rows, "mem", enc, max_length=64)
    batch = SFTCollator(tok_pe.pad_token_id, packed=False)([(e, None) for e in examples])
    short = examples[0]
    n = len(short.input_ids)
    assert batch.attention_mask[0, :n].all() and not batch.attention_mask[0, n:].any()
    assert batch.labels[0, n - 1] == tok_pe.eos_token_id  # the EOS is trained even though it equals pad
    assert (batch.labels[0, n:] == IGNORE_INDEX).all()
    assert batch.window_tokens.item() == sum(e.loss_tokens for e in examples)


def test_packing_resets_positions_and_blocks_cross_attention(tok):
    enc = ChatEncoder(tok)
    rows = [{"prompt": f"sort: {' '.join('dcba'[:k])}", "completion": " ".join("abcd"[:k])} for k in (2, 3, 4)]
    examples, _ = tokenize_rows(rows, "mem", enc, max_length=64)
    packed = pack(examples, max_length=64)
    assert len(packed) == 1
    row = packed[0]
    assert sum(e.loss_tokens for e in examples) == row.loss_tokens
    starts = [i for i, p in enumerate(row.position_ids) if p == 0]
    assert len(starts) == 3 and all(row.labels[s] == IGNORE_INDEX for s in starts)

    model = build_tiny_model(seed=0).eval()
    batch = SFTCollator(tok.pad_token_id, packed=True, pad_to_multiple_of=8)([(row, None)])
    assert batch.attention_mask is None
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[0]
        for s, e in zip(starts, starts[1:] + [len(row.input_ids)]):
            alone = model(input_ids=torch.tensor([row.input_ids[s:e]])).logits[0]
            torch.testing.assert_close(logits[s:e], alone, atol=1e-5, rtol=1e-4)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


GOOD = {"prompt": "sort: b a", "completion": "a b"}


@pytest.mark.parametrize(
    "bad_row, expect",
    [
        ('{"prompt": "sort: b a", "completion": ', ["row 2", "one JSON object per line"]),
        ({"prompt": "sort: b a"}, ["row 2", "expected a row with the fields"]),
        ({"prompt": "sort: b a", "completion": ""}, ["row 2", "field 'completion'", "non-empty string"]),
        ({"prompt": "sort: b a", "completion": 7}, ["row 2", "field 'completion'", "expected a string", "int"]),
        ({"messages": [{"role": "user", "content": "hi"}]}, ["row 2", "field 'messages'", "assistant"]),
        ({"messages": [{"role": "bot", "content": "hi"}]}, ["row 2", "field 'messages[0].role'"]),
        ([1, 2], ["row 2", "a JSON object"]),
        ({"prompt": "sort: " + "a " * 200, "completion": "a"}, ["row 2", "max_length=64", "tokens"]),
    ],
)
def test_bad_rows_name_file_row_and_field(tmp_path, tok, bad_row, expect):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, bad_row if isinstance(bad_row, str) else json.dumps(bad_row)])
    with pytest.raises(AlignDataError) as info:
        tokenize_rows(read_rows(path), path, ChatEncoder(tok), max_length=64)
    message = str(info.value)
    assert path in message
    for part in expect:
        assert part in message


def test_truncation_policies(tmp_path, tok):
    long = {"prompt": "sort: b a", "completion": "a " * 100}
    rows = [GOOD, long]
    enc = ChatEncoder(tok)
    kept, dropped = tokenize_rows(rows, "mem", enc, max_length=32, truncation="drop")
    assert (len(kept), dropped) == (1, 1)
    cut, dropped = tokenize_rows(rows, "mem", enc, max_length=32, truncation="right")
    assert dropped == 0 and len(cut[1].input_ids) == 32


def test_an_unknown_truncation_policy_fails_naming_the_setting():
    with pytest.raises(AlignConfigError, match=r"^data\.truncation: expected 'error', 'right' or 'drop', got 'left'$"):
        SFTDataModule(truncation="left")


def test_datamodule_on_bundled_data(tok):
    dm = SFTDataModule(batch_size=4, max_length=64)
    dm.set_tokenizer(tok)
    dm.setup("fit")
    assert len(dm.train_set) > 1000 and len(dm.val_set) > 50
    batch = next(iter(dm.val_dataloader()))
    assert batch.input_ids.shape[0] == 4 and batch.attention_mask is not None
    packed = SFTDataModule(batch_size=4, max_length=64, packing=True)
    packed.set_tokenizer(tok)
    packed.setup("fit")
    assert len(packed.train_set) < len(dm.train_set) / 2
    assert sum(e.loss_tokens for e in packed.train_set.examples) == sum(e.loss_tokens for e in dm.train_set.examples)

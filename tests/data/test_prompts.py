import json

import pytest

from align.data.chat import ChatEncoder
from align.data.prompts import PromptDataModule, collate_prompts, encode_prompt_rows
from align.errors import AlignDataError
from align.hub.tiny import load_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


def write(tmp_path, rows, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_rows_encode_with_template_once_and_keep_columns(tokenizer):
    enc = ChatEncoder(tokenizer)
    rows = [
        {"prompt": "sort: b a", "answer": "a b", "level": 1},
        {
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort: c a"}],
            "answer": "a c",
            "level": 2,
        },
    ]
    examples = encode_prompt_rows(rows, "x.jsonl", enc)
    assert examples[0].prompt_ids == enc.prompt_ids([{"role": "user", "content": "sort: b a"}])
    assert examples[0].prompt_ids.count(tokenizer.bos_token_id) == 1
    assert [e.prompt for e in examples] == ["sort: b a", "sort: c a"]
    batch = collate_prompts(examples)
    assert batch.columns == {"answer": ["a b", "a c"], "level": [1, 2]}
    prompts, columns = batch.repeat(2)
    assert prompts == ["sort: b a", "sort: b a", "sort: c a", "sort: c a"]
    assert columns["answer"] == ["a b", "a b", "a c", "a c"]
    # Rewards also get each prompt's whole conversation, as the policy saw it.
    assert batch.repeat_messages(1) == [[{"role": "user", "content": "sort: b a"}], rows[1]["prompt"]]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"question": "x"}, "row 2: field 'prompt': expected a row with a 'prompt' field"),
        ({"prompt": ""}, "row 2: field 'prompt': expected a non-empty string"),
        (
            {"prompt": [{"role": "assistant", "content": "hi"}]},
            "row 2: field 'prompt': expected a prompt that does not end",
        ),
        ({"prompt": "sort: " + "a " * 300}, "row 2: field 'prompt': expected at most max_prompt_length=256"),
        (
            {"prompt": "sort: b", "completion_ids": [1]},
            "row 2: field 'completion_ids': expected a column name other "
            "than 'completion_ids', which rewards receive from the rollout",
        ),
    ],
)
def test_bad_rows_name_file_row_field(tmp_path, tokenizer, row, message):
    path = write(tmp_path, [{"prompt": "sort: b a"}, row])
    dm = PromptDataModule(train_files=path, val_files=None)
    dm.set_tokenizer(tokenizer)
    with pytest.raises(AlignDataError) as info:
        dm.setup("fit")
    assert path in str(info.value) and message in str(info.value)


def test_bundled_data_and_held_out_split(tmp_path, tokenizer):
    dm = PromptDataModule(batch_size=4)
    dm.set_tokenizer(tokenizer)
    dm.setup("fit")
    assert len(dm.train_set) == 2000 and len(dm.val_set) == 100
    batch = next(iter(dm.train_dataloader()))
    assert len(batch) == 4 and len(batch.columns["answer"]) == 4

    path = write(tmp_path, [{"prompt": f"sort: {c} a", "answer": f"a {c}"} for c in "abcdefghij"])
    dm = PromptDataModule(train_files=path, val_size=3, batch_size=2)
    dm.set_tokenizer(tokenizer)
    dm.setup("fit")
    train = {e.prompt for e in dm.train_set.examples}
    val = {e.prompt for e in dm.val_set.examples}
    assert len(train) == 7 and len(val) == 3 and not train & val
    with pytest.raises(AlignDataError, match="val_size"):
        bad = PromptDataModule(train_files=path, val_size=10)
        bad.set_tokenizer(tokenizer)
        bad.setup("fit")

"""Generating with a trained policy (align.rollout.generation): the policy loaded from a model or checkpoint (and the
checkpoints refused), prompts read as training reads them, the commands' sampling settings, batches generated in
order and repeated by a seed, and output rows that keep every input column. What the commands print and write:
tests/cli/test_generation.py."""

from types import SimpleNamespace

import pytest
import torch
from cli._commands import ROWS, fails, read_jsonl, run, write_rows

from align.data.chat import ChatEncoder
from align.data.prompts import PromptExample
from align.errors import AlignConfigError, AlignDataError
from align.hub.tiny import load_tiny_tokenizer
from align.models.policy import PolicyModel
from align.rollout.engine import make_engine
from align.rollout.generation import (
    chat_reply,
    check_completion_field,
    completion_rows,
    generate_batches,
    load_policy,
    read_prompts,
    reference_policy,
    sampling_config,
)


@pytest.fixture
def prompts(tmp_path) -> str:
    return write_rows(tmp_path / "prompts.jsonl", ROWS)


def test_greedy_generation_is_deterministic_and_independent_of_the_batch_size(capsys, tmp_path, prompts):
    outputs = []
    for i, batch_size in enumerate(["8", "8", "1"]):
        path = tmp_path / f"g{i}.jsonl"
        run(
            capsys,
            "generate",
            "--model",
            "tiny-sort",
            "--prompts",
            prompts,
            "--output",
            str(path),
            "--batch_size",
            batch_size,
            "--max_new_tokens",
            "12",
        )
        outputs.append(read_jsonl(path))
    assert outputs[0] == outputs[1] == outputs[2]


def test_generate_several_samples_per_prompt_seeded(capsys, tmp_path, prompts):
    def sample(seed, name):
        path = tmp_path / name
        out, _ = run(
            capsys,
            "generate",
            "--model",
            "tiny-sort",
            "--prompts",
            prompts,
            "--output",
            str(path),
            "--n",
            "3",
            "--seed",
            seed,
            "--max_new_tokens",
            "8",
        )
        return read_jsonl(path), out

    rows, out = sample("1", "a.jsonl")
    assert len(rows) == 12 and [r["sample"] for r in rows] == [0, 1, 2] * 4
    assert [r["prompt"] for r in rows[:3]] == [ROWS[0]["prompt"]] * 3 and rows[3]["id"] == 7
    assert "generated 12 completions of 4 prompts" in out and "(temperature 1," in out
    assert sample("1", "b.jsonl")[0] == rows
    assert [r["completion"] for r in sample("2", "c.jsonl")[0]] != [r["completion"] for r in rows]


def test_messages_rows_get_the_chat_template_of_training(capsys, tmp_path):
    path = write_rows(
        tmp_path / "m.jsonl",
        [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "sort: b a"}], "k": 1}],
    )
    tokenizer = PolicyModel("tiny").tokenizer
    read = read_prompts(path, tokenizer)
    assert read.prompt_field == "messages" and read.examples[0].columns == {"k": 1}
    assert read.examples[0].prompt_ids == ChatEncoder(tokenizer).prompt_ids(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "sort: b a"}]
    )
    out, _ = run(
        capsys,
        "generate",
        "--model",
        "tiny-sort",
        "--prompts",
        path,
        "--output",
        str(tmp_path / "o.jsonl"),
        "--max_new_tokens",
        "4",
    )
    assert read_jsonl(tmp_path / "o.jsonl")[0]["messages"][0]["content"] == "Be brief."


def test_a_reward_model_checkpoint_is_refused_as_the_policy(capsys, tmp_path, prompts):
    fake = tmp_path / "rm.ckpt"
    torch.save({"align": {"policy": {"model": "tiny"}, "reward": {}}, "state_dict": {}}, fake)
    assert "is a reward-model checkpoint" in fails(
        capsys, "generate", "--model", str(fake), "--prompts", prompts, "--output", str(tmp_path / "o.jsonl")
    )


def test_the_commands_sampling_is_greedy_for_one_sample_and_names_their_flags():
    assert sampling_config(max_new_tokens=12).temperature == 0.0  # one sample per prompt: greedy
    assert sampling_config(n=3).temperature == 1.0  # several: n greedy samples would be n copies of one
    several = sampling_config(max_new_tokens=5, temperature=0.3, top_p=0.9, top_k=4, n=3)
    assert (several.max_new_tokens, several.temperature, several.top_p, several.top_k) == (5, 0.3, 0.9, 4)
    with pytest.raises(AlignConfigError, match=r"^--n: expected >= 1 samples per prompt, got 0$"):
        sampling_config(n=0)
    with pytest.raises(AlignConfigError, match=r"^--temperature: expected >= 0 \(0: greedy\), got -1\.0"):
        sampling_config(temperature=-1.0)
    with pytest.raises(AlignConfigError, match=r"^--top_p: "):
        sampling_config(top_p=0.0)


def test_prompts_are_read_from_the_field_named_or_found_with_every_column_kept(tmp_path):
    tokenizer = load_tiny_tokenizer()
    path = write_rows(tmp_path / "q.jsonl", [{"question": "sort: b a", "id": 1}, {"question": "sort: c", "id": 2}])
    read = read_prompts(path, tokenizer, prompt_field="question", system_prompt="Sort.")
    assert read.prompt_field == "question" and read.source == path
    assert [e.prompt for e in read.examples] == ["sort: b a", "sort: c"]
    assert [e.columns for e in read.examples] == [{"id": 1}, {"id": 2}]
    system = {"role": "system", "content": "Sort."}
    assert read.examples[0].prompt_ids == ChatEncoder(tokenizer).prompt_ids(
        [system, {"role": "user", "content": "sort: b a"}]
    )
    assert read_prompts(write_rows(tmp_path / "p.jsonl", ROWS), tokenizer).prompt_field == "prompt"


def test_output_rows_are_the_input_rows_with_the_completion_and_the_sample(tmp_path):
    read = read_prompts(write_rows(tmp_path / "p.jsonl", ROWS), load_tiny_tokenizer())
    rollout = SimpleNamespace(texts=["x", "y", "z", "w"], prompt_index=torch.tensor([0, 0, 1, 1]), group_size=2)
    rows = completion_rows(read, 2, rollout, completion_field="out")  # prompts 2 and 3 of the file
    assert rows == [
        {**ROWS[2], "out": "x", "sample": 0},
        {**ROWS[2], "out": "y", "sample": 1},
        {**ROWS[3], "out": "z", "sample": 0},
        {**ROWS[3], "out": "w", "sample": 1},
    ]
    one = SimpleNamespace(texts=["x"], prompt_index=torch.tensor([0]), group_size=1)
    assert completion_rows(read, 1, one) == [{**ROWS[1], "completion": "x"}]  # one sample: no index
    check_completion_field(read, "completion")  # no row has the column: fine
    with pytest.raises(
        AlignDataError,
        match=r"p\.jsonl: row 2: field 'id': expected no column with the name of the output's completion field, "
        r"which would overwrite it \(set --completion_field to another name\)$",
    ):
        check_completion_field(read, "id")


def test_a_model_that_is_not_a_generating_checkpoint_is_refused_on_one_line(tmp_path):
    missing = tmp_path / "missing.ckpt"
    with pytest.raises(AlignConfigError, match=rf"^--ckpt_path: checkpoint '{missing}' does not exist$"):
        load_policy(str(missing), what="--ckpt_path")
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_text("not a checkpoint")
    with pytest.raises(AlignConfigError, match=rf"^--model: '{garbage}' is not a readable checkpoint \(\w+: "):
        load_policy(str(garbage))
    with pytest.raises(
        AlignConfigError,
        match=r"^--baseline reference: only an align checkpoint records the model its run started from, and "
        r"'tiny-sort' is not one; give the baseline's path or model id instead$",
    ):
        reference_policy("tiny-sort")


def test_batches_of_prompts_keep_their_order_and_a_seed_repeats_the_samples():
    policy = load_policy("tiny-sort")
    assert not policy.training and not any(p.requires_grad for p in policy.parameters())
    tokenizer, sampling = policy.tokenizer, sampling_config(max_new_tokens=6, n=2)
    encoder = ChatEncoder(tokenizer)
    examples = [
        PromptExample(encoder.prompt_ids([{"role": "user", "content": p}]), p, {}, [])
        for p in ("sort: b a", "sort: d c", "sort: f e")
    ]
    first = list(generate_batches(policy, examples, sampling, n=2, batch_size=2, seed=3))
    assert [b.prompts for b, _ in first] == [["sort: b a", "sort: d c"], ["sort: f e"]]
    assert [len(r) for _, r in first] == [4, 2]
    again = list(generate_batches(policy, examples, sampling, n=2, batch_size=2, seed=3))
    assert [r.texts for _, r in again] == [r.texts for _, r in first]
    with pytest.raises(AlignConfigError, match=r"^--batch_size: expected >= 1 prompts per batch, got 0$"):
        next(generate_batches(policy, examples, sampling, batch_size=0))
    history = [{"role": "user", "content": "sort: b a"}]
    engine = make_engine(sampling_config(max_new_tokens=6))
    text, rollout = chat_reply(policy, encoder, history, engine)
    assert text == rollout.texts[0] == engine.generate(policy, [encoder.prompt_ids(history)], 1).texts[0]

"""Rollouts of given completions (align.rollout.given): a dataset's reference answers laid out as sampled responses
(tokenized, then the end of turn), cut at max_new_tokens like a sampled one, with zero sampling log-probs, and the
one-line errors of a missing column or an empty answer."""

import sys
from pathlib import Path

import pytest
import torch

from align.data.prompts import PromptBatch
from align.errors import AlignConfigError, AlignDataError
from align.models.policy import PolicyModel
from align.rollout.given import given_rollout
from align.rollout.sampling import left_pad

sys.path.insert(0, str(Path(__file__).parents[1] / "modules"))
from _helpers import prompt_batch  # noqa: E402


@pytest.fixture(scope="module")
def policy():
    return PolicyModel("tiny", seed=2)


def with_answers(policy):
    batch = prompt_batch(policy)
    return PromptBatch(batch.prompt_ids, batch.prompts, {"answer": ["a b c d", "a b", "a c c", "e f g j"]})


def test_given_rollout_lays_the_answers_out_as_responses(policy):
    batch = with_answers(policy)
    rollout = given_rollout(policy, batch, "answer", max_new_tokens=6)
    tok = policy.tokenizer
    first = tok("a b c d", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert rollout.response_ids[0, : len(first)].tolist() == first[:6]
    assert rollout.response_mask.sum(dim=1).tolist() == [
        min(len(tok(a, add_special_tokens=False)["input_ids"]) + 1, 6) for a in batch.columns["answer"]
    ]
    with pytest.raises(AlignConfigError, match=r"^model\.completion_column: the data rows have no 'gold' column"):
        given_rollout(policy, batch, "gold", max_new_tokens=6)
    batch.columns["answer"][1] = ""
    with pytest.raises(AlignDataError, match=r"field 'answer': expected a non-empty reference completion"):
        given_rollout(policy, batch, "answer", max_new_tokens=6)


def test_a_given_row_looks_like_a_sampled_one_and_a_long_answer_is_cut_as_truncated(policy):
    tok = policy.tokenizer
    batch = prompt_batch(policy, ["sort: b a", "sort: d c a b"])
    batch = PromptBatch(batch.prompt_ids, batch.prompts, {"answer": ["a b", "a b c d"]})
    ids = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in ("a b", "a b c d")]
    assert len(ids[0]) <= 4 < len(ids[1])  # the first answer and its end of turn fit in 4 tokens, the second not
    rollout = given_rollout(policy, batch, "answer", max_new_tokens=4)
    prompt_ids, prompt_mask = left_pad(batch.prompt_ids, tok.pad_token_id)
    assert torch.equal(rollout.prompt_ids, prompt_ids) and torch.equal(rollout.prompt_mask, prompt_mask)
    assert rollout.response_ids.shape == (2, 4)
    assert rollout.response_ids[0].tolist() == ids[0] + [tok.pad_token_id] * (4 - len(ids[0]))
    assert rollout.response_ids[1].tolist() == ids[1][:4]  # cut like a sampled response: no end of turn
    assert rollout.response_mask.tolist() == [[i < len(ids[0]) for i in range(4)], [True] * 4]
    assert rollout.truncated.tolist() == [False, True]
    assert torch.equal(rollout.old_logprobs, torch.zeros(2, 4))  # no policy sampled them
    assert rollout.texts == ["a b", "a b c d"] and rollout.prompt_index.tolist() == [0, 1]
    assert rollout.group_size == 1 and rollout.generation_seconds == 0.0


def test_an_answer_that_is_not_text_names_its_prompt(policy):
    batch = prompt_batch(policy, ["sort: b a"])
    batch = PromptBatch(batch.prompt_ids, batch.prompts, {"gold": [42]})
    with pytest.raises(
        AlignDataError,
        match=r"^the training data: field 'gold': expected a non-empty reference completion "
        r"\(model\.completion_column\) for the prompt 'sort: b a', got 42$",
    ):
        given_rollout(policy, batch, "gold", max_new_tokens=4)

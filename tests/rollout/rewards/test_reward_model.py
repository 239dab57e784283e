"""A trained reward model as a reward (align.rollout.rewards.reward_model), on the shipped ``tiny-sort-rm``: scores are
the model's on the rows it encodes, in any batch size; what it encodes (the text as one user message or the whole
conversation, the saved system prompt, the sampled ids when they are this tokenizer's, no end of turn after a cut
completion, a completion past max_length cut); and the lazy wrapper an RL module's ``reward_model`` block builds."""

import logging

import pytest
import torch

from align.errors import AlignConfigError
from align.rollout.rewards.reward_model import LazyRewardModel, RewardModelScorer

PROMPTS = ["sort: b a", "sort: c a b", "sort: d"]
COMPLETIONS = ["a b", "a b c", "d"]


@pytest.fixture(scope="module")
def scorer() -> RewardModelScorer:
    return RewardModelScorer("tiny-sort-rm", batch_size=2, device="cpu")


def direct(scorer, prompt_ids, response_ids) -> float:
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        return scorer.model(ids, torch.ones_like(ids)).item()


def test_scores_are_the_models_on_the_encoded_rows_in_any_batch_size(scorer):
    scores = scorer(PROMPTS, COMPLETIONS, answer=["ignored"] * 3)  # rows 0-1 in one batch, row 2 alone
    expected = [direct(scorer, *scorer.encode(p, c)) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert scores == pytest.approx(expected, abs=1e-5)
    one_by_one = RewardModelScorer("tiny-sort-rm", batch_size=1, device="cpu")
    assert one_by_one(PROMPTS, COMPLETIONS) == pytest.approx(scores, abs=1e-5)
    assert not any(p.requires_grad for p in scorer.model.parameters()) and not scorer.model.training


def test_a_prompt_text_is_one_user_message_and_a_system_prompt_is_added_only_where_none_is(scorer):
    user = [{"role": "user", "content": "sort: b a"}]
    system = [{"role": "system", "content": "Sort the letters."}]
    assert scorer.encode("sort: b a", "a b") == scorer.encode(user, "a b")
    assert scorer.encode(system + user, "a b")[0] != scorer.encode(user, "a b")[0]
    with_system = RewardModelScorer("tiny-sort-rm", device="cpu", system_prompt="Sort the letters.")
    assert with_system.encode("sort: b a", "a b") == scorer.encode(system + user, "a b")
    other = [{"role": "system", "content": "Be brief."}]
    assert with_system.encode(other + user, "a b") == scorer.encode(other + user, "a b")  # its own system kept


def test_sampled_ids_are_scored_as_they_are_when_this_tokenizer_decodes_them_to_the_completion(scorer):
    prompt_ids, reply = scorer.encode("sort: b a", "a b")
    eos = scorer.tokenizer.eos_token_id
    assert reply[-1] == eos  # the completion's text ends its turn
    assert scorer.encode("sort: b a", "a b", truncated=True) == (prompt_ids, reply[:-1])  # a cut one does not
    sampled = reply[:-1]
    assert scorer.encode("sort: b a", "a b", completion_ids=sampled)[1] == sampled  # used as sampled
    foreign = [len(scorer.tokenizer) + 5]  # ids outside this vocabulary: another tokenizer's, re-encoded
    assert scorer.encode("sort: b a", "a b", completion_ids=foreign)[1] == reply
    other_text = scorer.tokenizer("c", add_special_tokens=False)["input_ids"]
    assert scorer.encode("sort: b a", "a b", completion_ids=other_text)[1] == reply  # decodes to another text
    row = scorer(["sort: b a"], ["a b"], completion_ids=[sampled], completion_truncated=[False])
    assert row == pytest.approx([direct(scorer, prompt_ids, sampled)], abs=1e-5)


def test_a_completion_past_max_length_is_cut_with_a_warning(caplog):
    short = RewardModelScorer("tiny-sort-rm", device="cpu", max_length=6)
    whole_prompt, whole_reply = RewardModelScorer("tiny-sort-rm", device="cpu").encode("sort: b a", "a b c d e f g h")
    assert len(whole_reply) == 9  # 8 letters and the end of turn
    with caplog.at_level(logging.WARNING):
        prompt_ids, reply = short.encode("sort: b a", "a b c d e f g h")
    assert reply == whole_reply[:5]  # cut to max_length - 1 tokens
    assert "a completion of 9 tokens is cut to max_length - 1 = 5" in caplog.text
    assert prompt_ids == whole_prompt[-1:]  # the prompt keeps its last token in the one place left


def test_inputs_of_other_lengths_and_bad_settings_are_refused(scorer):
    with pytest.raises(ValueError, match=r"^RewardModelScorer: 1 prompts but 2 completions$"):
        scorer(["a"], ["a", "b"])
    with pytest.raises(ValueError, match=r"^RewardModelScorer: 1 completion_truncated for 2 completions$"):
        scorer(["a", "b"], ["a", "b"], completion_truncated=[True])
    with pytest.raises(AlignConfigError, match=r"^init_kwargs\.batch_size: expected an integer >= 1, got True$"):
        RewardModelScorer("tiny-sort-rm", batch_size=True)
    with pytest.raises(AlignConfigError, match=r"^init_kwargs\.dtype: expected auto, float32, bfloat16 or float16"):
        RewardModelScorer("tiny-sort-rm", dtype="int8")


def test_the_lazy_reward_model_loads_once_on_first_use_and_passes_only_the_reward_inputs(monkeypatch):
    lazy = LazyRewardModel("no/such/export", batch_size=3)  # nothing is read when it is built
    assert lazy.scorer is None
    built, calls = [], []

    class Recording:
        def __init__(self, path, batch_size, device):
            built.append((path, batch_size, device))

        def __call__(self, prompts, completions, **inputs):
            calls.append(inputs)
            return [0.5] * len(completions)

    monkeypatch.setattr("align.rollout.rewards.reward_model.RewardModelScorer", Recording)
    columns = dict(answer=["x"], prompt_messages=[[]], completion_ids=[[1]], completion_truncated=[False])
    assert lazy(["p"], ["c"], **columns) == [0.5]
    assert lazy(["p"], ["c"]) == [0.5]
    assert built == [("no/such/export", 3, None)]  # loaded on the first call only
    assert calls == [{"prompt_messages": [[]], "completion_ids": [[1]], "completion_truncated": [False]}, {}]
    assert lazy.load("cuda") is lazy.scorer  # already loaded: the device of a later load changes nothing

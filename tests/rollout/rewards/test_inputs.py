"""What every reward receives (align.rollout.rewards.inputs): for a single-turn rollout the prompts, completions and
columns repeated per completion, each row's sampled ids up to its length and its conversation; for a multi-turn
rollout the episode's first messages, the last turn's ids and the whole conversation."""

import torch

from align.data.prompts import REWARD_INPUTS, PromptBatch
from align.rollout.rewards.inputs import BASE_INPUTS, reward_inputs
from align.rollout.types import Rollout


def rollout(texts, response_ids, lengths, truncated, group_size=2, episodes=None) -> Rollout:
    """A rollout of ``len(texts)`` rows holding only what reward inputs read."""
    n, width = len(texts), len(response_ids[0])
    mask = torch.arange(width).expand(n, width) < torch.tensor(lengths)[:, None]
    return Rollout(
        prompt_ids=torch.zeros(n, 1, dtype=torch.long),
        prompt_mask=torch.ones(n, 1, dtype=torch.long),
        response_ids=torch.tensor(response_ids),
        response_mask=mask,
        old_logprobs=torch.zeros(n, width),
        truncated=torch.tensor(truncated),
        texts=texts,
        prompt_index=torch.arange(n) // group_size,
        group_size=group_size,
        generation_seconds=0.0,
        episodes=episodes,
    )


def test_single_turn_inputs_repeat_each_prompt_for_its_completions():
    batch = PromptBatch(prompt_ids=[[1], [2]], prompts=["sort: b a", "sort: c"], columns={"answer": ["a b", "c"]})
    rows = rollout(
        ["a b", "b", "c", ""], [[5, 6, 2], [6, 0, 0], [7, 7, 7], [2, 0, 0]], [3, 1, 3, 1], [False, False, True, False]
    )
    inputs = reward_inputs(batch, rows)
    assert list(inputs) == [*BASE_INPUTS, "answer", *REWARD_INPUTS]  # the order rewards receive them in
    assert inputs["prompts"] == ["sort: b a", "sort: b a", "sort: c", "sort: c"]
    assert inputs["completions"] == ["a b", "b", "c", ""]
    assert inputs["answer"] == ["a b", "a b", "c", "c"]
    user = [{"role": "user", "content": "sort: b a"}], [{"role": "user", "content": "sort: c"}]
    assert inputs["prompt_messages"] == [user[0], user[0], user[1], user[1]]  # the text as one user message
    assert inputs["completion_ids"] == [[5, 6, 2], [6], [7, 7, 7], [2]]  # cut at each row's length
    assert inputs["completion_truncated"] == [False, False, True, False]
    assert inputs["conversation"][1] == user[0] + [{"role": "assistant", "content": "b"}]
    assert inputs["conversation"][3] == user[1] + [{"role": "assistant", "content": ""}]


def test_a_batchs_own_conversations_are_the_prompt_messages():
    chat = [{"role": "system", "content": "Sort."}, {"role": "user", "content": "sort: b a"}]
    batch = PromptBatch(prompt_ids=[[1]], prompts=["sort: b a"], columns={}, messages=[chat])
    inputs = reward_inputs(batch, rollout(["a b"], [[5, 2]], [2], [False], group_size=1))
    assert inputs["prompt_messages"] == [chat]
    assert inputs["conversation"] == [chat + [{"role": "assistant", "content": "a b"}]]


def test_multi_turn_inputs_come_from_the_episodes():
    messages = [
        {"role": "user", "content": "guess"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "5"},
    ]
    episodes = [
        {"messages": messages, "first_messages": 1, "completion_ids": (9, 2)},
        {"messages": messages[:2], "first_messages": 1, "completion_ids": [8]},
    ]
    batch = PromptBatch(prompt_ids=[[1]], prompts=["guess"], columns={"level": [3]})
    # The response ids hold every turn of the episode; what a reward sees is the last turn's ids.
    rows = rollout(["5", "3"], [[4, 2, 7, 9, 2], [8, 0, 0, 0, 0]], [5, 1], [False, True], episodes=episodes)
    inputs = reward_inputs(batch, rows)
    assert list(inputs) == [*BASE_INPUTS, "level", *REWARD_INPUTS]
    assert inputs["prompts"] == ["guess", "guess"] and inputs["level"] == [3, 3]
    assert inputs["completions"] == ["5", "3"]
    assert inputs["prompt_messages"] == [messages[:1], messages[:1]]
    assert inputs["completion_ids"] == [[9, 2], [8]]
    assert inputs["completion_truncated"] == [False, True]
    assert inputs["conversation"] == [messages, messages[:2]]

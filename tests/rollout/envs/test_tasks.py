"""The bundled multi-turn task (align.rollout.envs.tasks): letter sorting over rounds, each round answered exactly
worth 1 / rounds, every round played, and its rows drawn from a seeded generator."""

import random

import pytest

from align.data import sort_task
from align.rollout.envs.tasks import SortRounds, sort_rounds_row


def test_sort_rounds_rewards_each_round_and_ends_after_the_last():
    env = SortRounds()
    first = env.reset(
        {"prompt": "sort: b a", "rounds": ["sort: d c a"], "messages": [{"role": "user", "content": "sort: b a"}]}
    )
    assert first == [{"role": "user", "content": "sort: b a"}]
    step = env.step({"role": "assistant", "content": "a b"})
    assert (step.messages, step.reward, step.done) == ([{"role": "user", "content": "sort: d c a"}], 0.5, False)
    step = env.step({"role": "assistant", "content": "a b"})  # the first round's answer again: wrong
    assert (step.messages, step.reward, step.done, step.info) == ([], 0.0, True, {"solved_rounds": 0.0})


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def answer(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_a_row_without_rounds_is_one_round_worth_the_whole_reward():
    env = SortRounds()
    assert env.reset({"prompt": "sort: c a", "messages": user("sort: c a")}) == user("sort: c a")
    assert env.step(answer("a c")) == ([], 1.0, True, {"solved_rounds": 1.0})


def test_every_round_is_played_whatever_the_earlier_answers_and_a_reset_starts_again():
    env = SortRounds()
    row = {"prompt": "sort: b a", "rounds": ["sort: c b", "sort: d a"], "messages": user("sort: b a")}
    env.reset(row)
    # Three rounds: each answered exactly earns 1/3; a wrong first answer does not end the episode.
    assert env.step(answer("b a")) == (user("sort: c b"), 0.0, False, {"solved_rounds": 0.0})
    assert env.step(answer("b c")) == (user("sort: d a"), pytest.approx(1 / 3), False, {"solved_rounds": 1.0})
    assert env.step(answer("a d")) == ([], pytest.approx(1 / 3), True, {"solved_rounds": 1.0})
    env.reset(row)
    assert env.step(answer("a b")).messages == user("sort: c b")  # the first round again


def test_a_row_is_its_rounds_drawn_from_the_generator_in_order():
    row = sort_rounds_row(random.Random(7), rounds=3, min_len=2, max_len=4)
    rng = random.Random(7)
    problems = [sort_task.sample_problem(rng, 2, 4) for _ in range(3)]
    assert row == {
        "prompt": problems[0]["prompt"],
        "rounds": [problems[1]["prompt"], problems[2]["prompt"]],
        "answer": " | ".join(p["answer"] for p in problems),
    }
    single = sort_rounds_row(random.Random(7), rounds=1, min_len=3, max_len=3)
    assert single["rounds"] == [] and " | " not in single["answer"]
    assert len(sort_task.prompt_letters(single["prompt"])) == 3

"""Rewards of a batch evaluated together (align.rollout.rewards.concurrent): async rewards awaited together, plain
ones on threads, ``concurrency`` parts, a per-reward timeout, and a failure in a part named by its row of the whole
batch."""

import asyncio
import threading

import pytest

from align.rollout.rewards import CombinedReward, RewardError, RewardSpec
from align.rollout.rewards.concurrent import split_rows


def test_split_rows_cuts_lists_of_the_batch_and_passes_the_rest_whole():
    inputs = {"completions": list("abcde"), "answer": list("ABCDE"), "scale": 2, "pair": [1, 2]}
    parts = split_rows(inputs, 5, 2)
    assert [offset for offset, _ in parts] == [0, 2]  # round(2.5) == 2: rows 0-1 and 2-4
    assert parts[0][1] == {"completions": ["a", "b"], "answer": ["A", "B"], "scale": 2, "pair": [1, 2]}
    assert parts[1][1]["completions"] == ["c", "d", "e"]
    assert [o for o, _ in split_rows(inputs, 5, 9)] == [0, 1, 2, 3, 4]  # at most one part per row
    assert split_rows(inputs, 5, 1) == [(0, inputs)]


def test_plain_rewards_run_on_threads_at_the_same_time():
    # Each waits for the other at a barrier: run one after the other, the first would wait in vain.
    barrier = threading.Barrier(2, timeout=20)
    threads = {}

    def meet(name):
        def reward(completions, **kw):
            threads[name] = threading.current_thread() is threading.main_thread()
            barrier.wait()
            return [1.0] * len(completions)

        reward.__name__ = name
        return reward

    total, parts = CombinedReward([meet("first"), meet("second")])(["p"] * 2, ["a", "b"])
    assert total == [2.0, 2.0]
    assert threads == {"first": True, "second": False}  # the first plain one runs in the calling thread


def test_async_rewards_are_awaited_together_and_concurrency_cuts_the_batch():
    seen, events = [], {}

    def event(name):
        return events.setdefault(name, asyncio.Event())

    async def ping(completions, **kw):
        event("ping").set()
        await asyncio.wait_for(event("pong").wait(), 20)
        return [0.5] * len(completions)

    async def pong(completions, **kw):
        event("pong").set()
        await asyncio.wait_for(event("ping").wait(), 20)
        return [0.25] * len(completions)

    barrier = threading.Barrier(2, timeout=20)

    def parts_of_two(completions, **kw):
        seen.append(list(completions))
        barrier.wait()  # both parts at once
        return [float(len(c)) for c in completions]

    combined = CombinedReward([ping, pong, RewardSpec(parts_of_two, concurrency=2)])
    assert [r.is_async for r in combined.rewards] == [True, True, False]
    total, parts = combined(["p"] * 4, ["a", "bb", "ccc", "dddd"])
    assert parts == {"ping": [0.5] * 4, "pong": [0.25] * 4, "parts_of_two": [1.0, 2.0, 3.0, 4.0]}
    assert sorted(seen) == [["a", "bb"], ["ccc", "dddd"]]


def test_a_reward_past_its_timeout_stops_the_run_and_an_async_one_is_cancelled():
    release, cancelled = threading.Event(), []

    def stuck(completions, **kw):
        release.wait(30)
        return [0.0] * len(completions)

    async def stuck_async(completions, **kw):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return [0.0] * len(completions)

    try:
        with pytest.raises(
            RewardError,
            match=r"reward 'stuck' .* did not return within its timeout of 0.2 s on a "
            r"batch of 2 completions; raise the reward's timeout",
        ):
            CombinedReward([RewardSpec(stuck, timeout=0.2)])(["p"] * 2, ["a", "b"])
    finally:
        release.set()
    with pytest.raises(RewardError, match=r"rows 0-0, one of 2 parts"):
        CombinedReward([RewardSpec(stuck_async, timeout=0.2, concurrency=2)])(["p"] * 2, ["a", "b"])
    deadline = threading.Event()
    for _ in range(100):
        if len(cancelled) == 2:
            break
        deadline.wait(0.05)
    assert cancelled == [True, True]


def test_a_failure_in_a_part_names_the_sample_of_the_whole_batch():
    def picky(completions, **kw):
        if "bad" in completions:
            raise ValueError("cannot score 'bad'")
        return [1.0] * len(completions)

    with pytest.raises(
        RewardError,
        match=r"raised ValueError: cannot score 'bad'.* first failing sample 3 of 4: "
        r"prompt 'p', completion 'bad'",
    ):
        CombinedReward([RewardSpec(picky, concurrency=2)])(["p"] * 4, ["a", "b", "c", "bad"])

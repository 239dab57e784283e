"""Rewards of a batch evaluated together: async rewards awaited together, plain ones on threads, ``concurrency``
parts, a per-reward timeout, ``None`` for "not applicable", and a failure on one rank stopping every rank."""

import asyncio
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from align.errors import AlignConfigError
from align.rollout.rewards import CombinedReward, RewardCounts, RewardError, RewardFunction, RewardSpec
from align.rollout.rewards.concurrent import split_rows

REPO = Path(__file__).resolve().parents[2]


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


def test_none_means_not_applicable_excluded_from_the_total_without_renormalising():
    def only_even(completions, **kw):
        return [1.0 if i % 2 == 0 else None for i in range(len(completions))]

    async def only_first(completions, **kw):
        return [0.5] + [None] * (len(completions) - 1)

    combined = CombinedReward([RewardSpec(only_even, weight=2.0), RewardSpec(only_first, weight=1.0)])
    total, parts = combined(["p"] * 3, ["a", "b", "c"])
    # row 0: 2*1 + 1*0.5; row 1: nothing applies; row 2: 2*1 (only_first's weight is not spread onto only_even)
    assert total == [2.5, 0.0, 2.0]
    assert parts == {"only_even": [1.0, 0.0, 1.0], "only_first": [0.5, 0.0, 0.0]}
    assert combined.last_counts == RewardCounts(3, {"only_even": 1, "only_first": 2}, {})
    counts = RewardCounts(0, {"only_even": 0, "only_first": 0}, {})
    counts.add(combined.last_counts)
    counts.add(combined.last_counts)
    assert counts.metrics() == pytest.approx(
        {"rollout/reward_na/only_even": 2 / 6, "rollout/reward_na/only_first": 4 / 6}
    )


def test_spec_settings_are_checked():
    for settings, message in (
        ({"concurrency": 0}, r"concurrency: expected an integer >= 1, got 0$"),
        ({"concurrency": 1.5}, r"concurrency: expected an integer >= 1, got 1\.5$"),
        ({"timeout": 0}, r"timeout: expected a number of seconds > 0 or null, got 0$"),
        ({"timeout": float("inf")}, r"timeout: expected a number of seconds > 0 or null, got inf$"),
    ):
        with pytest.raises(AlignConfigError, match=r"^model\.rewards\[2\]\." + message):
            RewardFunction(RewardSpec("align.rewards.sort_format", **settings), setting="model.rewards[2]")
        with pytest.raises(
            AlignConfigError, match=r"^reward 'sort_format' \(align\.rewards\.sort_format\): " + message
        ):
            RewardFunction(RewardSpec("align.rewards.sort_format", **settings))


def test_math_verify_runs_off_the_main_thread():
    # math-verify's own timeouts use signal.alarm, which raises off the main thread; the reward turns them off there.
    combined = CombinedReward([RewardSpec("align.rewards.math_verify", concurrency=2)])
    total, _ = combined(["q"] * 4, ["\\boxed{3/4}", "0.75", "1", "x"], answer=["\\frac{3}{4}"] * 4)
    assert total == [1.0, 1.0, 0.0, 0.0]


RANKS_CHILD = """
import os, sys
import torch.distributed as dist
from align.rollout.rewards import CombinedReward, RewardError
from align.rollout.sampler import stop_together
from align.core.stats import Ranks

rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{sys.argv[2]}")
ranks = Ranks(rank, 2, lambda t: (dist.all_reduce(t), t)[1])


def fussy(completions, **kw):
    if rank == 1 and "b" in completions:
        raise ValueError("rank 1 cannot score this")
    return [1.0] * len(completions)


reward = CombinedReward([fussy])
for batch in (["a"], ["b"]):
    error = None
    try:
        reward(["p"], batch)
    except Exception as err:
        error = err
    try:
        stop_together(error, ranks)
        print("scored", batch, flush=True)
    except RewardError as err:
        print("stopped:", err, flush=True)
        break
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_reward_failing_on_one_rank_stops_every_rank_with_the_same_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANKS_CHILD, str(rank), str(port)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    lines = [out.strip().splitlines() for out, _ in outs]
    assert lines[0][0] == lines[1][0] == "scored ['a']"
    assert lines[0][1] == lines[1][1]
    assert lines[0][1].startswith("stopped: reward 'fussy'") and "rank 1 cannot score this" in lines[0][1]
    assert lines[0][1].endswith("[scoring failed on rank 1 of 2; every rank stops]")

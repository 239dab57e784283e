"""The shared event loop of asynchronous environments (align.rollout.envs.loop): one loop on a daemon thread for the
whole process, coroutines run on it from any thread, a call past its timeout cancelled with a one-line error, and a
new loop started when the old one was closed."""

import asyncio
import threading

import pytest

from align.rollout.envs import loop


def test_every_thread_runs_its_coroutines_on_one_daemon_loop():
    async def where():
        return asyncio.get_running_loop(), threading.current_thread()

    seen = []
    threads = [threading.Thread(target=lambda: seen.append(loop.run(where(), timeout=10))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seen.append(loop.run(where(), timeout=10))
    loops, runners = {id(lp) for lp, _ in seen}, {th for _, th in seen}
    assert len(loops) == 1 and len(runners) == 1
    runner = runners.pop()
    assert runner.name == "align-env-loop" and runner.daemon and runner is not threading.current_thread()


def test_a_result_or_an_exception_comes_back_to_the_caller():
    async def add(a, b):
        await asyncio.sleep(0)
        return a + b

    async def fails():
        raise KeyError("no such episode")

    assert loop.run(add(2, 3), timeout=10) == 5
    assert loop.submit(add(4, 5)).result(timeout=10) == 9
    with pytest.raises(KeyError, match="no such episode"):
        loop.run(fails(), timeout=10)


def test_a_call_past_its_timeout_is_cancelled_and_says_how_long_it_waited():
    cancelled = threading.Event()

    async def stuck():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError, match=r"^no answer within 0\.2 s$"):
        loop.run(stuck(), timeout=0.2)
    assert cancelled.wait(10)


def test_call_soon_completes_a_future_on_the_loops_thread():
    async def wait_for_it():
        future = asyncio.get_running_loop().create_future()
        threading.Thread(target=lambda: loop.call_soon(future.set_result, "done")).start()
        return await future

    assert loop.run(wait_for_it(), timeout=10) == "done"


def test_a_closed_loop_is_replaced_by_a_new_one():
    old = loop.loop()
    old.call_soon_threadsafe(old.stop)
    for _ in range(200):
        if not old.is_running():
            break
        threading.Event().wait(0.01)
    old.close()
    new = loop.loop()
    assert new is not old and not new.is_closed()

    async def answer():
        return 42

    assert loop.run(answer(), timeout=10) == 42

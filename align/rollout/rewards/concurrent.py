"""Calls of a batch's rewards run together, each within its own time limit.

:func:`run_jobs` starts every call at once: an ``async`` function (or an object whose ``__call__`` is ``async``) on
the process's reward event loop (:func:`reward_loop`, one daemon thread), so that the calls of every async reward are
awaited together; a plain function on a daemon thread of its own. One plain call may run in the calling thread
instead (``inline``), after the others have started: it costs no thread, and a library that needs the main thread
(math-verify's ``signal.alarm``) gets it there. Each call's ``timeout`` counts from the start of them all; a call
past it is cancelled when it is async (its HTTP requests are dropped) and abandoned when it is a thread (a daemon
thread: it cannot keep the process alive after the run stops on it).

:func:`split_rows` cuts a batch's inputs into contiguous parts, for a reward whose ``concurrency`` is above 1;
:func:`evaluate` runs a batch's rewards this way, and :class:`RewardCounts` counts the rows they did not apply to or
scored by default. Clients that async rewards keep on the loop are closed when the process exits
(:func:`close_at_exit`).
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, NamedTuple

_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None
_loop_lock = threading.Lock()
_closers: list[weakref.WeakMethod] = []


def reward_loop() -> asyncio.AbstractEventLoop:
    """The event loop that async rewards run on: started on first use in a daemon thread, and kept for the process,
    so that a client an async reward holds (an HTTP connection pool) is reused from batch to batch."""
    global _loop, _loop_thread
    with _loop_lock:
        if _loop is None or _loop_thread is None or _loop.is_closed() or not _loop_thread.is_alive():
            _loop = asyncio.new_event_loop()
            _loop_thread = threading.Thread(target=_loop.run_forever, name="align-rewards-loop", daemon=True)
            _loop_thread.start()
            atexit.register(_close_loop, _loop)
        return _loop


def close_at_exit(close: Callable[[], Any]) -> None:
    """Await ``close()`` (a bound method, such as an HTTP client's) on the reward loop when the process exits, so
    that its connections are closed while the interpreter still runs; forgotten when its object is."""
    _closers.append(weakref.WeakMethod(close))


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    async def close_all() -> None:
        for ref in _closers:
            close = ref()
            if close is not None:
                try:
                    await close()
                except Exception:  # noqa: BLE001 - closing at exit: nothing is left to report to
                    pass

    if loop.is_closed() or _loop_thread is None or not _loop_thread.is_alive():
        return
    try:
        asyncio.run_coroutine_threadsafe(close_all(), loop).result(5)
    except Exception:  # noqa: BLE001 - closing at exit: nothing is left to report to
        pass
    loop.call_soon_threadsafe(loop.stop)


def on_reward_loop() -> bool:
    """Whether the calling thread is the reward loop's (where waiting for the loop would never end)."""
    return _loop_thread is not None and threading.current_thread() is _loop_thread


class JobTimeout(Exception):
    """A call that did not return within its job's timeout."""


class Job(NamedTuple):
    """One call: ``call()`` returns the result, or a coroutine when ``is_async``; ``timeout`` in seconds or None."""

    call: Callable[[], Any]
    is_async: bool
    timeout: float | None = None


async def _awaited(call: Callable[[], Any]) -> Any:
    return await call()


def _in_thread(call: Callable[[], Any]) -> Future:
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(call())
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            future.set_exception(err)

    threading.Thread(target=run, name="align-reward", daemon=True).start()
    return future


def start(job: Job) -> Future:
    """Start ``job``: on the reward loop when it is async, else on a daemon thread."""
    if job.is_async:
        if on_reward_loop():
            raise RuntimeError(
                "an async reward was started from the reward loop's own thread, where waiting for it "
                "would never end; await the reward instead"
            )
        return asyncio.run_coroutine_threadsafe(_awaited(job.call), reward_loop())
    return _in_thread(job.call)


def run_now(job: Job) -> Any:
    """``job``'s result, waited for here (within its timeout); an error it raised is raised here."""
    if not job.is_async:
        return job.call()
    return _result(start(job), None if job.timeout is None else time.monotonic() + job.timeout, job.timeout)


def _result(future: Future, deadline: float | None, timeout: float | None) -> Any:
    try:
        value = future.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
    except (FutureTimeout, CancelledError):
        future.cancel()
        raise JobTimeout(
            "was cancelled" if timeout is None else f"did not return within its timeout of {timeout:g} s"
        ) from None
    if inspect.isawaitable(value):  # a plain callable that returned a coroutine: await it on the loop
        return _result(asyncio.run_coroutine_threadsafe(_awaited(lambda: value), reward_loop()), deadline, timeout)
    return value


def run_jobs(jobs: Sequence[Job], inline: int | None = None) -> list[Any]:
    """Run ``jobs`` together and return, in order, each one's result or the exception it raised (a
    :class:`JobTimeout` for one past its timeout). ``inline``: the index of a plain job without a timeout to run in
    the calling thread once the others have started.

    The results are waited for in order; at the first job that failed, the jobs not yet finished are cancelled
    (async) or abandoned (threads), and their places hold ``None``."""
    if inline is not None and (jobs[inline].is_async or jobs[inline].timeout is not None):
        raise ValueError("only a plain job without a timeout runs inline")
    started = time.monotonic()
    futures = [None if i == inline else start(job) for i, job in enumerate(jobs)]
    results: list[Any] = [None] * len(jobs)
    if inline is not None:
        try:
            results[inline] = jobs[inline].call()
        except Exception as err:  # noqa: BLE001 - returned to the caller, which names the reward
            results[inline] = err
    for i, future in enumerate(futures):
        if future is not None:
            timeout = jobs[i].timeout
            try:
                results[i] = _result(future, None if timeout is None else started + timeout, timeout)
            except Exception as err:  # noqa: BLE001 - returned to the caller, which names the reward
                results[i] = err
        if isinstance(results[i], BaseException):
            for rest in futures[i + 1 :]:
                if rest is not None:
                    rest.cancel()
            break
    return results


def split_rows(inputs: dict[str, Any], n: int, parts: int) -> list[tuple[int, dict[str, Any]]]:
    """``inputs`` (each list of ``n`` values cut, anything else passed whole) in ``parts`` contiguous pieces of
    near-equal size, as ``(offset of the first row, inputs)``; fewer pieces when there are fewer rows."""
    parts = max(1, min(parts, n))
    if parts == 1:
        return [(0, inputs)]
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [
        (lo, {k: (v[lo:hi] if isinstance(v, (list, tuple)) and len(v) == n else v) for k, v in inputs.items()})
        for lo, hi in zip(bounds, bounds[1:])
    ]


@dataclass
class RewardCounts:
    """What one call of a :class:`CombinedReward` counted: its ``rows``, and per reward the rows it did not apply to
    (``not_applicable``: it returned None) and the rows it scored by default after a failed call (``errors``: only
    the rewards that count them)."""

    rows: int = 0
    not_applicable: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)

    def add(self, other: RewardCounts) -> None:
        self.rows += other.rows
        for mine, theirs in ((self.not_applicable, other.not_applicable), (self.errors, other.errors)):
            for name, count in theirs.items():
                mine[name] = mine.get(name, 0) + count

    def metrics(self, prefix: str = "rollout") -> dict[str, float]:
        """``<prefix>/reward_na/<name>`` and ``<prefix>/reward_errors/<name>``: shares of the rows counted."""
        rows = max(self.rows, 1)
        return {
            **{f"{prefix}/reward_na/{k}": v / rows for k, v in self.not_applicable.items()},
            **{f"{prefix}/reward_errors/{k}": v / rows for k, v in self.errors.items()},
        }


def evaluate(rewards: Sequence[Any], inputs: dict[str, Any]) -> dict[str, list[float | None]]:
    """Each of ``rewards`` (:class:`~align.rollout.rewards.RewardFunction`) on the batch ``inputs``, all at once:
    ``{name: values}``, checked (``None`` where a reward does not apply). A reward with ``concurrency`` above 1 is
    called on that many parts of the batch at once. The first plain reward that has neither concurrency nor a timeout
    runs in the calling thread. The first failure, in the order of the rewards, is raised as a
    :class:`~align.rollout.rewards.RewardError` that names the reward."""
    n = len(inputs["completions"])
    jobs, owners = [], []
    for reward in rewards:
        for offset, part in split_rows(inputs, n, reward.concurrency):
            jobs.append(Job(reward.bound(part), reward.is_async, reward.timeout))
            owners.append((reward, offset, part))
    inline = next(
        (i for i, (r, _, _) in enumerate(owners) if not r.is_async and r.timeout is None and r.concurrency == 1), None
    )
    results = run_jobs(jobs, inline)
    out: dict[str, list[float | None]] = {r.name: [] for r in rewards}
    for (reward, offset, part), result in zip(owners, results):
        if isinstance(result, BaseException):
            raise reward.failure(result, part, offset, n)
        out[reward.name].extend(reward.checked(result, part, offset))
    return out


__all__ = [
    "Job",
    "JobTimeout",
    "RewardCounts",
    "close_at_exit",
    "evaluate",
    "on_reward_loop",
    "reward_loop",
    "run_jobs",
    "run_now",
    "split_rows",
    "start",
]

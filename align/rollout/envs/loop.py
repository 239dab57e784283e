"""One asyncio event loop on a daemon thread, for environments whose library is asynchronous (an OpenEnv client,
a verifiers rollout): align's environment pool calls ``reset``/``step`` from worker threads, and each call hands
its coroutine to this loop and waits for the result. Every client of a process shares the loop, so a rollout of
256 episodes holds 256 connections on one thread instead of one thread each."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any

__all__ = ["submit", "run", "call_soon"]

_LOOP: asyncio.AbstractEventLoop | None = None
_LOCK = threading.Lock()


def loop() -> asyncio.AbstractEventLoop:
    """The shared loop, started on first use (a daemon thread, so it never keeps the process alive)."""
    global _LOOP
    with _LOCK:
        if _LOOP is None or _LOOP.is_closed():
            ready = threading.Event()
            new = asyncio.new_event_loop()

            def serve() -> None:
                asyncio.set_event_loop(new)
                ready.set()
                new.run_forever()

            threading.Thread(target=serve, name="align-env-loop", daemon=True).start()
            ready.wait()
            _LOOP = new
        return _LOOP


def submit(coro: Coroutine) -> concurrent.futures.Future:
    """Schedule ``coro`` on the shared loop; its future, for a thread to wait on."""
    return asyncio.run_coroutine_threadsafe(coro, loop())


def run(coro: Coroutine, timeout: float) -> Any:
    """Run ``coro`` on the shared loop and wait up to ``timeout`` seconds for its result (TimeoutError after that,
    and the coroutine is cancelled)."""
    future = submit(coro)
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"no answer within {timeout:g} s") from None


def call_soon(fn, *args) -> None:
    """Call ``fn(*args)`` on the loop's thread (to complete an asyncio future from another thread)."""
    loop().call_soon_threadsafe(fn, *args)

"""What rewards served over the network share (:class:`align.rewards.Judge`, :class:`align.rewards.Remote`): the key
from an environment variable named in the config (never the key itself), bounded concurrency, retries with backoff
on the failures worth retrying (a timeout, a failed connection, HTTP 429 or 5xx), a default score for a call that
still fails, and the count of such failures (``take_errors``, logged as ``rollout/reward_errors/<name>``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import re
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from align.errors import INIT_KWARGS, AlignConfigError
from align.observability.attributes import looks_secret
from align.rollout.rewards.concurrent import close_at_exit

log = logging.getLogger(__name__)
T = TypeVar("T")

REWARDS_EXTRA = "pip install 'align[rewards]'"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_QUERY_SECRET = re.compile(r"(^|&)(api[-_]?key|key|token|access[-_]?token|secret)=", re.I)


def _looks_like_a_key(text: str) -> bool:
    """A credential's shape, for a value that should be an environment variable's name: a provider prefix (``sk-``,
    ``hf_``, ``Bearer ...``), or a long run of lower-case letters and digits without an underscore."""
    if looks_secret(text):
        return True
    return len(text) >= 24 and bool(re.search(r"\d", text)) and bool(re.search(r"[a-z]", text)) and "_" not in text


def check_no_secrets(
    what: str, api_key_env: str | None, url: str | None, url_name: str = "url", **settings: Any
) -> None:
    """Refuse a config that seems to hold a key: ``api_key_env`` must be the NAME of an environment variable, the
    URL (the setting ``url_name``) must carry no credentials, and no other string setting may look like a key. The
    messages name the setting under ``what`` (``init_kwargs``) and never repeat the value."""
    hint = (
        "a key is never written in a config (it would be saved with the run); put it in an environment variable "
        "and name that variable in api_key_env"
    )
    if api_key_env is not None and (
        not isinstance(api_key_env, str) or not _ENV_NAME.match(api_key_env) or _looks_like_a_key(api_key_env)
    ):
        raise AlignConfigError(
            f"{what}.api_key_env: expected the name of an environment variable (such as "
            f"OPENAI_API_KEY), got a value that is not one; {hint}"
        )
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise AlignConfigError(f"{what}.{url_name}: expected an http:// or https:// URL, got {url!r}")
        if parts.username or parts.password or _QUERY_SECRET.search(parts.query or ""):
            raise AlignConfigError(
                f"{what}.{url_name}: expected a URL without credentials, got one that carries them; {hint}"
            )
    for name, value in _strings(settings):
        if looks_secret(value):
            raise AlignConfigError(
                f"{what}.{name}: expected no key in a config, got a value that looks like one; {hint}"
            )


def _strings(settings: dict[str, Any], prefix: str = ""):
    for key, value in settings.items():
        if isinstance(value, str):
            yield f"{prefix}{key}", value
        elif isinstance(value, dict):
            yield from _strings(value, f"{prefix}{key}.")


def _positive(what: str, name: str, value: Any, integer: bool = False, zero: bool = False) -> None:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        kind = "an integer" if integer else "a number"
        raise AlignConfigError(f"{what}.{name}: expected {kind} {'>= 0' if zero else '> 0'}, got {value!r}")


class ServiceReward:
    """Base of the rewards that call a service: settings, key, concurrency, retries, default score, error count.

    Built from a reward's ``init_kwargs``: a bad setting raises ``AlignConfigError("init_kwargs.<setting>: ...")``,
    which the reward that builds it places under its own setting (``model.rewards[0].init_kwargs.<setting>``)."""

    what = "reward"
    """How warnings and missing packages name the reward."""
    where = INIT_KWARGS
    """Where its settings are, as its errors name them."""

    def __init__(
        self,
        api_key_env: str | None,
        url: str | None,
        default: float | None,
        max_concurrency: int,
        timeout: float,
        retries: int,
        backoff: float,
        api_key: Any = None,
        url_name: str = "url",
        **settings: Any,
    ):
        if api_key is not None:
            raise AlignConfigError(
                f"{self.where}.api_key: expected no key in a config (it would be saved with the "
                "run), got one; put it in an environment variable and name that variable in "
                "api_key_env"
            )
        check_no_secrets(self.where, api_key_env, url, url_name, **settings)
        _positive(self.where, "max_concurrency", max_concurrency, integer=True)
        _positive(self.where, "timeout", timeout)
        _positive(self.where, "retries", retries, integer=True, zero=True)
        _positive(self.where, "backoff", backoff, zero=True)
        if default is not None and not (isinstance(default, (int, float)) and math.isfinite(default)):
            raise AlignConfigError(f"{self.where}.default: expected a finite number or null, got {default!r}")
        if api_key_env is not None and not os.environ.get(api_key_env):
            raise AlignConfigError(
                f"{self.where}.api_key_env: expected a set environment variable, got {api_key_env}, "
                "which is not set or is empty; export it with the key before the run"
            )
        self.api_key_env, self.default = api_key_env, default
        self.max_concurrency, self.timeout, self.retries, self.backoff = max_concurrency, timeout, retries, backoff
        self._errors = 0
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict] = weakref.WeakKeyDictionary()

    def api_key(self) -> str | None:
        """The key, read from ``api_key_env`` when a client is made (kept in no setting); None without one."""
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    def take_errors(self) -> int:
        """Completions scored ``default`` after a failed call since the last time asked."""
        errors, self._errors = self._errors, 0
        return errors

    def per_loop(self, name: str, make: Callable[[], T]) -> T:
        """An object bound to the running event loop (a semaphore, an HTTP client), made once per loop; one with an
        async ``close`` is closed when the process exits."""
        mine = self._per_loop.setdefault(asyncio.get_running_loop(), {})
        if name not in mine:
            mine[name] = made = make()
            close = getattr(made, "close", None)
            if inspect.iscoroutinefunction(close):
                close_at_exit(close)
        return mine[name]

    def retryable(self, err: BaseException) -> bool:
        """Whether a failed call is worth trying again: a timeout, a failed connection, HTTP 429 or a 5xx (subclasses
        say which of their errors are which); never another 4xx or a reply that does not parse."""
        return isinstance(err, (asyncio.TimeoutError, TimeoutError, ConnectionError))

    async def attempt(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` under the concurrency bound, tried again ``retries`` times with exponential backoff
        (``backoff``, 2x, 4x... seconds) while it fails in a :meth:`retryable` way; the last failure is raised."""
        semaphore = self.per_loop("semaphore", lambda: asyncio.Semaphore(self.max_concurrency))
        for tried in range(self.retries + 1):
            try:
                async with semaphore:
                    return await call()
            except Exception as err:  # noqa: BLE001 - retried or raised below
                if tried == self.retries or not self.retryable(err):
                    raise
            await asyncio.sleep(self.backoff * 2**tried)
        raise AssertionError("unreachable")

    def failed(self, rows: int, err: BaseException, failures: list[str]) -> list[float | None]:
        """Count ``rows`` completions scored by default after ``err``; their scores."""
        self._errors += rows
        failures.append(describe(err))
        return [self.default] * rows

    @property
    def label(self) -> str:
        """How warnings name this reward."""
        return self.what

    def report(self, failures: list[str], calls: int) -> None:
        """Warn once per batch when calls failed, with the first failure."""
        if failures:
            log.warning(
                "%s: %d of %d calls failed and were scored %s (first: %s)",
                self.label,
                len(failures),
                calls,
                "as not applicable" if self.default is None else self.default,
                failures[0],
            )


def describe(err: BaseException) -> str:
    """One short line for a failed call."""
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {text[:200]}"


__all__ = ["REWARDS_EXTRA", "ServiceReward", "check_no_secrets", "describe"]

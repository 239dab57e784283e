"""``Remote``: a reward served over HTTP.

The completions of a batch are POSTed in pieces of ``batch_size`` (several at once, ``max_concurrency``) to ``url``
as JSON::

    {"prompts": ["..."], "completions": ["..."], "columns": {"answer": ["..."]}}

``columns`` holds the data's columns, and the rollout's inputs named in ``inputs`` (``prompt_messages``,
``completion_ids``, ``completion_truncated``, ``conversation``). The reply is the list of scores, one per completion
in order, or ``{"scores": [...]}``; a ``null`` score means the reward does not apply to that completion. A request
that times out, fails to connect, or gets HTTP 429 or a 5xx is retried with backoff; one that still fails, or whose
reply is not such a list, scores ``default`` for its completions, which are counted
(``rollout/reward_errors/<name>``). The key, when the service needs one, is read from the environment variable named
by ``api_key_env`` and sent as ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from align.data.prompts import REWARD_INPUTS
from align.errors import AlignConfigError
from align.rollout.rewards.service import REWARDS_EXTRA, ServiceReward


class HTTPStatusError(Exception):
    """A reply whose HTTP status is not 2xx."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {' '.join(body.split())[:160]}")
        self.status = status


def read_scores(reply: Any, n: int) -> list[float | None]:
    """The ``n`` scores of a service's reply (a list, or ``{"scores": list}``): numbers or None. Raises ValueError
    for anything else."""
    scores = reply.get("scores") if isinstance(reply, dict) else reply
    if not isinstance(scores, list):
        raise ValueError(f'expected a list of scores or {{"scores": [...]}}, got {str(reply)[:80]}')
    if len(scores) != n:
        raise ValueError(f"expected {n} scores, got {len(scores)}")
    out: list[float | None] = []
    for i, value in enumerate(scores):
        if value is None:
            out.append(None)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append(float(value))
        else:
            raise ValueError(f"score {i} is {value!r}, not a finite number or null")
    return out


class Remote(ServiceReward):
    """A reward computed by an HTTP service (``fn: align.rewards.Remote`` with ``init_kwargs``; docs/rewards.md)."""

    what = "align.rewards.Remote"

    def __init__(
        self,
        url: str,
        batch_size: int = 64,
        inputs: list[str] | None = None,
        api_key_env: str | None = None,
        default: float | None = 0.0,
        max_concurrency: int = 4,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 1.0,
        api_key: Any = None,
    ):
        """
        Args:
            url: Where to POST, e.g. ``http://localhost:9000/score``.
            batch_size: Completions per request.
            inputs: Rollout inputs to send besides the data's columns (``prompt_messages``, ``completion_ids``,
                ``completion_truncated``, ``conversation``).
            api_key_env: The NAME of the environment variable that holds the service's key; None: no key.
            default: The score of the completions of a request that failed; None: not applicable.
            max_concurrency: Requests in flight at once.
            timeout: Seconds per request.
            retries: Further tries of a request that timed out, failed to connect or got HTTP 429 or 5xx.
            backoff: Seconds before the first retry, doubled for each next one.
            api_key: Refused: keys come from ``api_key_env``.
        """
        super().__init__(api_key_env, url, default, max_concurrency, timeout, retries, backoff, api_key)
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            raise AlignConfigError(f"{self.what} needs the aiohttp package; install it with: {REWARDS_EXTRA}") from None
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise AlignConfigError(f"{self.where}.batch_size: expected an integer >= 1, got {batch_size!r}")
        unknown = sorted(set(inputs or []) - set(REWARD_INPUTS))
        if unknown:
            raise AlignConfigError(
                f"{self.where}.inputs: expected rollout inputs, some of {list(REWARD_INPUTS)} (the "
                f"data's columns are always sent), got {unknown}"
            )
        self.url, self.batch_size, self.inputs = url, batch_size, list(inputs or [])

    def __repr__(self) -> str:
        return f"Remote(url={self.url!r}, batch_size={self.batch_size})"

    @property
    def label(self) -> str:
        return f"remote reward at {self.url}"

    def retryable(self, err: BaseException) -> bool:
        import aiohttp

        if isinstance(err, HTTPStatusError):
            return err.status == 429 or err.status >= 500
        return isinstance(err, aiohttp.ClientConnectionError) or super().retryable(err)

    def _session(self):
        import aiohttp

        key = self.api_key()
        return aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            headers={"Authorization": f"Bearer {key}"} if key else None,
        )

    async def post(self, body: dict[str, Any]) -> Any:
        """The service's JSON reply to ``body`` (retried as the settings say)."""
        session = self.per_loop("session", self._session)
        data = json.dumps(body, default=str)

        async def once() -> Any:
            async with session.post(self.url, data=data, headers={"Content-Type": "application/json"}) as reply:
                text = await reply.text()
                if not 200 <= reply.status < 300:
                    raise HTTPStatusError(reply.status, text)
                return json.loads(text)

        return await self.attempt(once)

    async def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        n = len(completions)
        sent = {
            k: list(v)
            for k, v in columns.items()
            if (k not in REWARD_INPUTS or k in self.inputs) and isinstance(v, (list, tuple)) and len(v) == n
        }
        failures: list[str] = []

        async def piece(lo: int) -> list[float | None]:
            hi = min(lo + self.batch_size, n)
            body = {
                "prompts": list(prompts[lo:hi]),
                "completions": list(completions[lo:hi]),
                "columns": {k: v[lo:hi] for k, v in sent.items()},
            }
            try:
                return read_scores(await self.post(body), hi - lo)
            except Exception as err:  # noqa: BLE001 - a failed request scores the default and is counted
                return self.failed(hi - lo, err, failures)

        starts = range(0, n, self.batch_size)
        pieces = await asyncio.gather(*(piece(lo) for lo in starts))
        self.report(failures, len(starts))
        return [score for scores in pieces for score in scores]


__all__ = ["HTTPStatusError", "Remote", "read_scores"]

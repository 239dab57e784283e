"""What the rewards served over the network share (align.rollout.rewards.service): keys kept out of configs, each
setting checked, retries with doubling backoff on the failures worth retrying, bounded concurrency, and failed calls
scored by default, counted and reported once per batch."""

import asyncio
import logging
import re

import pytest

from align.errors import AlignConfigError
from align.rollout.rewards import RewardFunction, RewardSpec
from align.rollout.rewards.service import ServiceReward, describe


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"api_key": "sk-abcdefghijklmnopqrstuvwx"}, "init_kwargs.api_key: expected no key in a config"),
        (
            {"api_key_env": "sk-abcdefghijklmnopqrstuvwx"},
            "init_kwargs.api_key_env: expected the name of an environment variable",
        ),
        (
            {"api_key_env": "abcdef0123456789abcdef0123456789"},
            "init_kwargs.api_key_env: expected the name of an environment variable",
        ),
        (
            {"api_key_env": "ALIGN_TEST_UNSET_KEY_VARIABLE"},
            "init_kwargs.api_key_env: expected a set environment variable, "
            "got ALIGN_TEST_UNSET_KEY_VARIABLE, which is not set",
        ),
        (
            {"base_url": "http://user:pw0rdpw0rd@127.0.0.1:1/v1"},
            "init_kwargs.base_url: expected a URL without credentials, got one that carries them",
        ),
        (
            {"base_url": "http://127.0.0.1:1/v1?api_key=abc123"},
            "init_kwargs.base_url: expected a URL without credentials",
        ),
        (
            {"extra_body": {"auth": "Bearer abcdefghijklmnopqrstuvwx"}},
            "init_kwargs.extra_body.auth: expected no key in a config, got a value that looks like one",
        ),
    ],
)
def test_a_config_that_seems_to_hold_a_key_is_refused_without_repeating_it(settings, message):
    spec = RewardSpec(
        "align.rewards.Judge", init_kwargs={"model": "m", "base_url": "http://127.0.0.1:1/v1", **settings}
    )
    with pytest.raises(AlignConfigError, match="^" + re.escape("model.rewards[0]." + message)) as info:
        RewardFunction(spec, setting="model.rewards[0]")
    for value in settings.values():
        for secret in value.values() if isinstance(value, dict) else [value]:
            if "ALIGN_TEST" not in secret:
                assert secret not in str(info.value)


def service(**settings) -> ServiceReward:
    """A ServiceReward with quick defaults; ``settings`` override them."""
    base = dict(
        api_key_env=None,
        url="http://127.0.0.1:1/x",
        default=0.0,
        max_concurrency=2,
        timeout=1.0,
        retries=2,
        backoff=0.5,
    )
    return ServiceReward(**{**base, **settings})


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"max_concurrency": 0}, "init_kwargs.max_concurrency: expected an integer > 0, got 0"),
        ({"max_concurrency": 1.0}, "init_kwargs.max_concurrency: expected an integer > 0, got 1.0"),
        ({"timeout": True}, "init_kwargs.timeout: expected a number > 0, got True"),
        ({"timeout": float("inf")}, "init_kwargs.timeout: expected a number > 0, got inf"),
        ({"retries": -1}, "init_kwargs.retries: expected an integer >= 0, got -1"),
        ({"backoff": -0.5}, "init_kwargs.backoff: expected a number >= 0, got -0.5"),
        ({"default": float("-inf")}, "init_kwargs.default: expected a finite number or null, got -inf"),
        ({"default": "0"}, "init_kwargs.default: expected a finite number or null, got '0'"),
        ({"api_key": "anything"}, "init_kwargs.api_key: expected no key in a config (it would be saved with the run)"),
        ({"url": "127.0.0.1:8000/x"}, "init_kwargs.url: expected an http:// or https:// URL, got '127.0.0.1:8000/x'"),
        (
            {"url": "https://host/x?token=abc"},
            "init_kwargs.url: expected a URL without credentials, got one that carries them",
        ),
        (
            {"headers": {"x": {"auth": "hf_abcdefghijklmnopqrst"}}},
            "init_kwargs.headers.x.auth: expected no key in a config, got a value that looks like one",
        ),
    ],
)
def test_each_setting_is_checked_naming_it_under_init_kwargs(settings, message):
    with pytest.raises(AlignConfigError, match="^" + re.escape(message)):
        service(**settings)


def test_zero_retries_and_backoff_are_allowed_and_the_key_is_read_when_asked(monkeypatch):
    assert service(retries=0, backoff=0).api_key() is None  # no api_key_env: no key
    monkeypatch.setenv("SERVICE_TEST_KEY", "k-1")
    reward = service(api_key_env="SERVICE_TEST_KEY")
    monkeypatch.setenv("SERVICE_TEST_KEY", "k-2")  # read when a client is made, not kept from construction
    assert reward.api_key() == "k-2"
    monkeypatch.setenv("SERVICE_TEST_KEY", "")
    with pytest.raises(AlignConfigError, match=r"^init_kwargs\.api_key_env: expected a set environment variable"):
        service(api_key_env="SERVICE_TEST_KEY")  # set but empty is not set


def test_a_retryable_failure_is_tried_again_with_doubling_backoff(monkeypatch):
    slept, calls = [], []

    async def no_wait(seconds):
        slept.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", no_wait)

    def failing(times, err):
        async def call():
            calls.append(1)
            if len(calls) <= times:
                raise err
            return "ok"

        return call

    reward = service(retries=2, backoff=0.5)
    # Two timeouts, then an answer: three calls, 0.5 s then 1.0 s between them.
    assert asyncio.run(reward.attempt(failing(2, TimeoutError("slow")))) == "ok"
    assert len(calls) == 3 and slept == [0.5, 1.0]
    # Three failed connections with two retries: the third failure is raised.
    calls.clear(), slept.clear()
    with pytest.raises(ConnectionError, match="refused"):
        asyncio.run(reward.attempt(failing(3, ConnectionRefusedError("refused"))))
    assert len(calls) == 3 and slept == [0.5, 1.0]
    # A failure that is not worth retrying (a reply that does not parse) is raised at once.
    calls.clear(), slept.clear()
    with pytest.raises(ValueError, match="no number"):
        asyncio.run(reward.attempt(failing(1, ValueError("no number"))))
    assert len(calls) == 1 and slept == []


def test_at_most_max_concurrency_calls_run_at_once():
    running, most = [0], [0]

    async def call():
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.01)
        running[0] -= 1
        return running[0]

    async def batch(reward):
        return await asyncio.gather(*(reward.attempt(call) for _ in range(6)))

    asyncio.run(batch(service(max_concurrency=2)))
    assert most == [2]


def test_one_object_per_event_loop():
    reward = service()

    async def made():
        first = reward.per_loop("thing", object)
        assert reward.per_loop("thing", object) is first  # made once in this loop
        return first

    assert asyncio.run(made()) is not asyncio.run(made())  # a new loop makes its own


def test_failed_calls_score_the_default_are_counted_once_and_reported_once(caplog):
    reward = service(default=0.25)
    failures: list[str] = []
    assert reward.failed(2, TimeoutError(), failures) == [0.25, 0.25]
    assert reward.failed(1, ValueError("bad\n   reply " + "x" * 300), failures) == [0.25]
    assert failures[0] == "TimeoutError: TimeoutError"  # no message: the type names it
    assert failures[1] == "ValueError: " + ("bad reply " + "x" * 300)[:200]  # one line, cut to 200 characters
    assert reward.take_errors() == 3 and reward.take_errors() == 0
    with caplog.at_level(logging.WARNING):
        reward.report(failures, calls=4)
        reward.report([], calls=4)  # nothing failed: nothing said
        service(default=None).report(["TimeoutError: TimeoutError"], calls=1)
    assert [r.getMessage() for r in caplog.records] == [
        "reward: 2 of 4 calls failed and were scored 0.25 (first: TimeoutError: TimeoutError)",
        "reward: 1 of 1 calls failed and were scored as not applicable (first: TimeoutError: TimeoutError)",
    ]


def test_describe_is_one_short_line():
    assert describe(OSError("connection\n\treset  by peer")) == "OSError: connection reset by peer"
    assert describe(asyncio.TimeoutError()) == "TimeoutError: TimeoutError"

"""align.rewards.Remote against a JSON service the test starts on loopback: batching, what is sent, null scores,
retries, and a failed request scored by default and counted."""

import re

import pytest
from _loopback import Loopback, Reply

from align.errors import AlignConfigError
from align.rollout.rewards import CombinedReward, Remote, RewardFunction, RewardSpec
from align.rollout.rewards.remote import read_scores


def remote_spec(server, name="remote", **kwargs) -> RewardSpec:
    return RewardSpec(
        "align.rewards.Remote",
        name=name,
        init_kwargs={"url": f"{server.url}/score", "backoff": 0.0, "timeout": 5.0, **kwargs},
    )


def length_scores(request):
    """The service: the length of each completion, null for an empty one."""
    return {"scores": [len(c) or None for c in request.body["completions"]]}


def test_read_scores():
    assert read_scores([1, None, 0.5], 3) == [1.0, None, 0.5]
    assert read_scores({"scores": [2]}, 1) == [2.0]
    for reply, message in (
        ([1], "expected 2 scores"),
        ({"score": [1, 2]}, "expected a list"),
        ([1, "high"], "score 1 is 'high'"),
        ([True, 1], "score 0 is True"),
    ):
        with pytest.raises(ValueError, match=message):
            read_scores(reply, 2)


def test_batches_are_posted_with_the_columns_and_the_scores_come_back_in_order(monkeypatch):
    monkeypatch.setenv("REMOTE_TEST_KEY", "r-456")
    completions = ["a", "bb", "", "dddd", "eeeee", "ffffff", "g"]
    with Loopback(length_scores) as server:
        combined = CombinedReward(
            [remote_spec(server, batch_size=3, inputs=["completion_truncated"], api_key_env="REMOTE_TEST_KEY")]
        )
        total, parts = combined(
            ["p"] * 7, completions, answer=list("0123456"), completion_truncated=[False] * 7, completion_ids=[[1]] * 7
        )
    assert parts["remote"] == [1.0, 2.0, 0.0, 4.0, 5.0, 6.0, 1.0] and total == parts["remote"]
    assert combined.last_counts.not_applicable == {"remote": 1} and combined.last_counts.errors == {"remote": 0}
    bodies = sorted((r.body for r in server.requests), key=lambda b: b["columns"]["answer"][0])
    assert [len(b["completions"]) for b in bodies] == [3, 3, 1]
    assert bodies[1] == {
        "prompts": ["p"] * 3,
        "completions": ["dddd", "eeeee", "ffffff"],
        "columns": {"answer": ["3", "4", "5"], "completion_truncated": [False] * 3},
    }
    assert all(r.path == "/score" and r.headers["authorization"] == "Bearer r-456" for r in server.requests)


def test_a_5xx_is_retried_and_a_bad_reply_scores_the_default():
    replies = iter([Reply("overloaded", 503), Reply({"scores": [1.0, 2.0]})])
    with Loopback(lambda r: next(replies)) as server:
        remote = RewardFunction(remote_spec(server, retries=1))
        assert remote(["p", "p"], ["a", "b"]) == [1.0, 2.0] and remote.take_errors() == 0
    with Loopback(lambda r: [1.0]) as server:  # one score for two completions
        remote = RewardFunction(remote_spec(server, default=-1.0))
        assert remote(["p", "p"], ["a", "b"]) == [-1.0, -1.0] and remote.take_errors() == 2
        assert len(server.requests) == 1
    with Loopback(lambda r: Reply([1.0], delay=2.0)) as server:
        remote = RewardFunction(remote_spec(server, timeout=0.2, retries=1))
        assert remote(["p"], ["a"]) == [0.0] and remote.take_errors() == 1
        assert len(server.requests) == 2


def test_settings_are_checked():
    for settings, message in (
        ({"batch_size": 0}, "batch_size: expected an integer >= 1, got 0"),
        (
            {"inputs": ["answer"]},
            "inputs: expected rollout inputs, some of ['prompt_messages', "
            "'completion_ids', 'completion_truncated', 'conversation'] (the "
            "data's columns are always sent), got ['answer']",
        ),
        ({"url": "ftp://host/x"}, "url: expected an http:// or https:// URL, got 'ftp://host/x'"),
        ({"max_concurrency": 0}, "max_concurrency: expected an integer > 0, got 0"),
        ({"retries": -1}, "retries: expected an integer >= 0, got -1"),
        ({"default": float("nan")}, "default: expected a finite number or null, got nan"),
    ):
        spec = RewardSpec("align.rewards.Remote", init_kwargs={"url": "http://127.0.0.1:1/s", **settings})
        with pytest.raises(AlignConfigError, match=f"^{re.escape('model.rewards[0].init_kwargs.' + message)}$"):
            RewardFunction(spec, setting="model.rewards[0]")
        with pytest.raises(AlignConfigError, match=f"^{re.escape('init_kwargs.' + message)}$"):
            Remote(**spec.init_kwargs)

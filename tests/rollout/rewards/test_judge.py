"""align.rewards.Judge against an OpenAI-compatible server the test starts on loopback: the parsers, what is sent,
retries on 429/5xx and timeouts only, the default score and error count of a failed call, and its settings'
checks (keys kept out of configs: test_service.py)."""

import logging
import re
import socket

import pytest
from _loopback import Loopback, Reply, chat_reply, user_message

from align.errors import AlignConfigError
from align.rollout.rewards import CombinedReward, Judge, RewardError, RewardFunction, RewardSpec
from align.rollout.rewards.judge import parse_choice, parse_number, parse_yes_no

FAST = dict(backoff=0.0, timeout=5.0)


def judge_spec(server, name="judge", **kwargs) -> RewardSpec:
    return RewardSpec(
        "align.rewards.Judge",
        name=name,
        init_kwargs={"model": "judge-model", "base_url": server.base_url, **FAST, **kwargs},
    )


@pytest.mark.parametrize(
    "reply, normalize, value",
    [
        ("7", True, 0.7),
        ("Score: 7/10", True, 0.7),
        ("7.5", False, 7.5),
        ("0", True, 0.0),
        ("10.", True, 1.0),
    ],
)
def test_parse_number(reply, normalize, value):
    assert parse_number(reply, 0, 10, normalize) == pytest.approx(value)


@pytest.mark.parametrize("reply, message", [("11", "outside"), ("-1", "outside"), ("great answer", "no number")])
def test_parse_number_refuses(reply, message):
    with pytest.raises(ValueError, match=message):
        parse_number(reply, 0, 10)


def test_parse_yes_no_and_choice():
    assert [parse_yes_no(r) for r in ("Yes.", "no, it is wrong", "NO", "I'd say yes")] == [1.0, 0.0, 0.0, 1.0]
    assert [parse_choice(r) for r in ("A", "[[B]]", "Response B is better.", "B, because A rambles")] == [0, 1, 1, 1]
    for parse, reply in ((parse_yes_no, "maybe"), (parse_choice, "Both are fine"), (parse_choice, "a or b")):
        with pytest.raises(ValueError):
            parse(reply)


def test_a_number_judge_fills_the_template_and_sends_the_settings(monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "k-123")

    def score_length(request):  # the "judge": the length of the response, on 0..10
        return str(len(re.search(r"Response: (.*)\nReference", user_message(request)).group(1)))

    with Loopback(score_length) as server:
        reward = RewardFunction(
            judge_spec(
                server,
                template="Question: {prompt}\nResponse: {completion}\nReference: {answer}",
                system_prompt="Be strict.",
                api_key_env="JUDGE_TEST_KEY",
                max_tokens=4,
                extra_body={"top_k": 1},
            )
        )
        assert reward.is_async and reward.counts_errors
        values = reward(["q1", "q2"], ["abc", "abcdefgh"], answer=["x", "y"])
    assert values == pytest.approx([0.3, 0.8])
    first = next(r for r in server.requests if "abc\n" in user_message(r))
    assert user_message(first) == "Question: q1\nResponse: abc\nReference: x"
    assert first.path == "/v1/chat/completions" and first.body["model"] == "judge-model"
    assert first.body["messages"][0] == {"role": "system", "content": "Be strict."}
    assert first.body["max_tokens"] == 4 and first.body["temperature"] == 0.0 and first.body["top_k"] == 1
    assert first.headers["authorization"] == "Bearer k-123"


def test_without_a_key_the_sdks_own_key_is_never_sent(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-should-not-leave-this-process")
    with Loopback(lambda r: "yes") as server:
        assert RewardFunction(judge_spec(server, parser="yes_no"))(["q"], ["a"]) == [1.0]
    assert "sk-should" not in server.requests[0].headers.get("authorization", "")


def test_429_and_5xx_are_retried_then_the_reply_counts():
    replies = iter([Reply({"error": "slow down"}, 429), Reply({"error": "oops"}, 503), chat_reply("yes")])
    with Loopback(lambda r: next(replies)) as server:
        judge = RewardFunction(judge_spec(server, parser="yes_no", retries=2))
        assert judge(["q"], ["a"]) == [1.0]
        assert len(server.requests) == 3 and judge.take_errors() == 0


def test_a_4xx_is_not_retried_and_scores_the_default(caplog):
    with Loopback(lambda r: Reply({"error": "bad model"}, 404)) as server:
        judge = RewardFunction(judge_spec(server, parser="yes_no", retries=3, default=0.25))
        with caplog.at_level(logging.WARNING):
            assert judge(["q", "q"], ["a", "b"]) == [0.25, 0.25]
    assert len(server.requests) == 2 and judge.take_errors() == 2 and judge.take_errors() == 0
    assert "judge judge-model at" in caplog.text and "2 of 2 calls failed and were scored 0.25" in caplog.text


def test_a_timeout_is_retried_and_then_scores_the_default():
    with Loopback(lambda r: Reply(chat_reply("9").body, delay=2.0)) as server:
        judge = RewardFunction(judge_spec(server, timeout=0.2, retries=1))
        assert judge(["q"], ["a"]) == [0.0]
    assert len(server.requests) == 2 and judge.take_errors() == 1


def test_a_refused_connection_is_retried_and_then_scores_the_default():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = RewardFunction(
        RewardSpec(
            "align.rewards.Judge",
            init_kwargs={"model": "m", "base_url": f"http://127.0.0.1:{port}/v1", "retries": 1, **FAST},
        )
    )
    assert judge(["q"], ["a"]) == [0.0] and judge.take_errors() == 1


def test_a_garbage_reply_scores_the_default_and_is_counted_in_the_metrics():
    with Loopback(lambda r: "what a lovely response" if "bad" in user_message(r) else "8") as server:
        combined = CombinedReward([judge_spec(server), RewardSpec("align.rewards.sort_format")])
        total, parts = combined(["sort: b a"] * 3, ["a b", "bad", "b a"])
    assert parts["judge"] == pytest.approx([0.8, 0.0, 0.8])
    assert combined.last_counts.errors == {"judge": 1}  # sort_format counts no errors
    assert combined.last_counts.metrics() == pytest.approx(
        {"rollout/reward_na/judge": 0.0, "rollout/reward_na/sort_format": 0.0, "rollout/reward_errors/judge": 1 / 3}
    )
    assert len(server.requests) == 3  # a reply that does not parse is not asked again


def test_a_default_of_none_makes_a_failed_call_not_applicable():
    with Loopback(lambda r: "I cannot tell") as server:
        combined = CombinedReward(
            [judge_spec(server, parser="yes_no", default=None), RewardSpec("align.rewards.sort_format", weight=0.5)]
        )
        total, parts = combined(["sort: b a"], ["a b"])
    assert total == [0.5] and parts["judge"] == [0.0]
    assert combined.last_counts.not_applicable == {"judge": 1, "sort_format": 0}


def test_pairwise_prefers_one_completion_of_each_pair():
    def shorter(request):
        text = user_message(request)
        a, b = (re.search(rf"Response {x}:\n(.*?)(\n\n|$)", text, re.S).group(1) for x in "AB")
        return "[[A]]" if len(a) <= len(b) else "[[B]]"

    with Loopback(shorter) as server:
        judge = RewardFunction(judge_spec(server, parser="pairwise"))
        assert judge(["p", "p", "q", "q"], ["a b", "a", "x", "x y z"]) == [0.0, 1.0, 1.0, 0.0]
        assert len(server.requests) == 2
        both = RewardFunction(judge_spec(server, parser="pairwise", both_orders=True, name="both"))
        # "a" vs "b": equal lengths, so the judge names whichever comes first, A, in both orders: a tie
        assert both(["p", "p", "q", "q"], ["a", "b", "x", "x y z"]) == [0.5, 0.5, 1.0, 0.0]
        with pytest.raises(RewardError, match="must share their prompt"):
            judge(["p", "q"], ["a", "b"])


def test_a_template_field_that_nothing_provides_fails_before_any_call():
    with Loopback(lambda r: "5") as server:
        combined = CombinedReward([judge_spec(server, template="{prompt} {completion} {solution}")])
        with pytest.raises(
            AlignConfigError,
            match=r"^reward 'judge' \(align\.rewards\.Judge, Judge\.__call__\): "
            r"init_kwargs\.template: expected fields that are data columns or "
            r"inputs \(known: answer, .*\), got \{solution\}$",
        ):
            combined.check_inputs(["answer"])
        placed = RewardFunction(
            judge_spec(server, template="{prompt} {completion} {solution}"), setting="model.rewards[0]"
        )
        with pytest.raises(
            AlignConfigError,
            match=r"^model\.rewards\[0\]\.init_kwargs\.template: expected fields "
            r"that are data columns or inputs \(known: .*\), got \{solution\}$",
        ):
            placed.check_inputs(["answer"])
        assert not server.requests
        with pytest.raises(
            AlignConfigError,
            match=r"^model\.rewards\[0\]\.init_kwargs\.template: expected the "
            r"field\(s\) \{completion\} of the number parser, got a template "
            r"without them$",
        ):
            RewardFunction(judge_spec(server, template="{prompt}"), setting="model.rewards[0]")


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"parser": "score"}, "parser: expected one of ['number', 'yes_no', 'pairwise'], got 'score'"),
        ({"low": float("nan")}, "low: expected a finite number, got nan"),
        ({"low": 5, "high": 5}, "high: expected a finite number above low=5, got 5"),
        ({"max_tokens": 0}, "max_tokens: expected an integer >= 1 or null, got 0"),
        (
            {"template": "{prompt"},
            "template: expected a format string (write a literal brace as {{ or }}), got one that "
            "is not (expected '}' before end of string)",
        ),
        ({"timeout": 0}, "timeout: expected a number > 0, got 0"),
    ],
)
def test_bad_judge_settings_fail_naming_their_place_in_the_config(settings, message):
    spec = RewardSpec(
        "align.rewards.Judge", init_kwargs={"model": "m", "base_url": "http://127.0.0.1:1/v1", **settings}
    )
    with pytest.raises(AlignConfigError, match=f"^{re.escape('model.eval_rewards[1].init_kwargs.' + message)}$"):
        RewardFunction(spec, setting="model.eval_rewards[1]")
    with pytest.raises(AlignConfigError, match=f"^{re.escape('init_kwargs.' + message)}$"):
        Judge(**spec.init_kwargs)


def test_a_judge_built_in_python_is_a_reward_too():
    with Loopback(lambda r: "yes") as server:
        judge = Judge(model="m", base_url=server.base_url, parser="yes_no", **FAST)
        assert RewardFunction(judge)(["q"], ["a"]) == [1.0]

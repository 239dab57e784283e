"""Tool calling: the call formats, the calculator, and a tool environment whose every failure (unknown tool, malformed
call, exception, timeout, huge output, too many calls) is a reply, not a crash. The python tool's own tests are in
tests/jail/test_sandbox.py."""

import time

import pytest

from align.rollout.envs.chat import EnvironmentPool, EnvironmentSpec
from align.rollout.envs.tools import ToolEnvironment, calculator, parse_tool_calls


def slow(seconds: float = 3.0) -> str:
    """Sleeps, then answers."""
    time.sleep(seconds)
    return "late"


def fails(x: str) -> str:
    """Always raises."""
    raise KeyError(x)


def chatty() -> str:
    """Returns a lot of text."""
    return "y" * 5000


def test_parse_tool_calls_reads_json_and_the_short_form_and_reports_bad_bodies():
    text = (
        'I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>\n'
        "<tool_call> calculator(4 * 5) </tool_call><tool_call>{not json</tool_call>"
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert calls[0] == {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    assert calls[1] == {"name": "calculator", "arguments": {"": "4 * 5"}}
    assert "could not read the tool call '{not json'" in calls[2]["error"]
    assert calls[3] == {"name": "f", "arguments": {"a": 1}}  # arguments written as a JSON string
    assert "needs a string 'name'" in calls[4]["error"]
    assert parse_tool_calls("no call here") == []


@pytest.mark.parametrize(
    "expression, value",
    [
        ("37 * 48", "1776"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),
        ("(2 + 3) ^ 2", "25"),
        ("-4 + 10 // 3", "-1"),
        ("2 ** 0.5", "1.4142135624"),
        ("12 % 5 =", "2"),
    ],
)
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, why",
    [
        ("__import__('os')", "unsupported expression element"),
        ("1 / 0", "division by zero"),
        ("9 ** 9999", "exponent too large"),
        ("2 +", "not an arithmetic expression"),
        ("", "expected an expression"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, why):
    with pytest.raises(ValueError, match=why):
        calculator(expression)


def env(**kw) -> ToolEnvironment:
    tools = ["align.rollout.envs.tools.calculator", f"{__file__}:slow", f"{__file__}:fails", f"{__file__}:chatty"]
    return ToolEnvironment(tools=tools, **kw)


def message(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_every_call_of_a_turn_is_answered_in_order_and_failures_are_replies():
    step = env(timeout=0.5, max_output_chars=100, error_reward=-0.1, max_calls=5).step(
        message(
            "<tool_call>calculator(6 * 7)</tool_call><tool_call>nope(1)</tool_call><tool_call>fails(k)</tool_call>"
            "<tool_call>slow()</tool_call><tool_call>chatty()</tool_call>"
        )
    )
    contents = [m["content"] for m in step.messages]
    assert [m["role"] for m in step.messages] == ["tool"] * 5
    assert contents[0] == "42"
    assert contents[1] == "error: unknown tool 'nope'; the tools are calculator, slow, fails, chatty"
    assert contents[2] == "error: KeyError: 'k'"
    assert contents[3] == "error: 'slow' did not finish within 0.5 s"
    assert contents[4].startswith("y" * 100 + "\n... [cut")
    assert not step.done and step.info == {"tool_calls": 5, "tool_errors": 3}
    assert step.reward == pytest.approx(-0.3)


def test_a_huge_result_is_cut_and_says_so():
    step = env(max_output_chars=100).step(message("<tool_call>chatty()</tool_call>"))
    assert step.messages[0]["content"] == "y" * 100 + "\n... [cut: 5000 characters in all]"


def test_calls_beyond_max_calls_are_refused_and_a_turn_without_call_ends_the_episode():
    step = env(max_calls=1).step(
        message("<tool_call>calculator(1+1)</tool_call><tool_call>calculator(2+2)</tool_call>")
    )
    assert [m["content"] for m in step.messages] == ["2", "error: at most 1 tool calls per turn"]
    final = env().step(message("The answer is 42."))
    assert final.done and final.messages == [] and final.info == {"tool_calls": 0, "tool_errors": 0}


def test_tool_entries_are_checked_when_the_environment_is_built():
    from align.errors import AlignConfigError

    with pytest.raises(
        AlignConfigError,
        match=r"^init_kwargs\.tools\[1\]\.name: expected a name no other tool has, "
        r"got 'calculator'; set 'name' on one of them$",
    ):
        ToolEnvironment(tools=["align.rollout.envs.tools.calculator", "align.rollout.envs.tools.calculator"])
    with pytest.raises(
        AlignConfigError,
        match=r"^init_kwargs\.tools\[0\]\.init_kwargs: expected null for a function "
        r"\(init_kwargs build a class\), got \{'x': 1\}$",
    ):
        ToolEnvironment(tools=[{"path": "align.rollout.envs.tools.calculator", "init_kwargs": {"x": 1}}])
    for settings, message in (
        (dict(max_calls=0), r"max_calls: expected an integer >= 1, got 0"),
        (dict(timeout=0), r"timeout: expected a number of seconds > 0, got 0"),
        (dict(max_output_chars=0), r"max_output_chars: expected an integer >= 1, got 0"),
        (
            dict(tools=[{"path": "align.rollout.envs.tools.PythonSandbox", "init_kwargs": {"memory_mb": 8}}]),
            r"tools\[0\]\.init_kwargs\.memory_mb: expected >= 32, got 8",
        ),
    ):
        with pytest.raises(AlignConfigError, match=rf"^init_kwargs\.{message}$"):
            ToolEnvironment(**settings)
        # built by the run, the environment's own settings are named where the config holds them
        pool = EnvironmentPool(EnvironmentSpec("align.rollout.envs.tools.ToolEnvironment", init_kwargs=settings))
        with pytest.raises(AlignConfigError, match=rf"^model\.environment\.init_kwargs\.{message}$"):
            pool.instance(0)
    named = ToolEnvironment(
        tools=[
            {"path": "align.rollout.envs.tools.PythonSandbox", "name": "py", "init_kwargs": {"timeout": 2}},
            calculator,
        ]
    )
    assert list(named.tools) == ["py", "calculator"] and named.tools["py"].timeout == 2


def test_tool_calls_parsed_by_a_response_template_are_used_as_given():
    parsed = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3*3"}}}],
    }
    step = env().step(parsed)
    assert step.messages == [{"role": "tool", "content": "9"}]
    odd = env().step({"role": "assistant", "content": "", "tool_calls": [{"function": "calculator(1)"}]})
    assert odd.messages[0]["content"].startswith("error: could not read the tool call") and not odd.done


def test_reset_puts_the_tool_list_into_the_system_message():
    tool_env = env(result_role="user")
    first = tool_env.reset({"messages": [{"role": "user", "content": "What is 2+2?"}]})
    assert first[0]["role"] == "system" and first[1] == {"role": "user", "content": "What is 2+2?"}
    assert "- calculator(expression: str): Evaluates an arithmetic expression." in first[0]["content"]
    assert "<tool_call>" in first[0]["content"]
    own = tool_env.reset({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}]})
    assert own[0]["content"].startswith("Be brief.\n\nYou can call tools.") and len(own) == 2
    assert tool_env.step(message("<tool_call>calculator(1)</tool_call>")).messages[0]["role"] == "user"

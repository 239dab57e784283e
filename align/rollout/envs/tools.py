"""Tool calling: an environment that runs the tools a policy calls and answers with their results
(docs/environments.md, "Tools").

A policy calls a tool by writing, anywhere in its turn::

    <tool_call>{"name": "calculator", "arguments": {"expression": "37 * 48"}}</tool_call>

(the JSON form of Hermes and Qwen2.5's templates), or, for a tool with one parameter, the short form
``<tool_call>calculator(37 * 48)</tool_call>``. A tokenizer with a response template (transformers'
``parse_response``) hands the episode loop its own parsed ``tool_calls`` instead, which are used as they are. Every call
of a turn is run, in order, and answered by one message (``result_role``, ``tool`` by default) holding its result or
``error: ...``. A turn without a tool call is the final answer: the episode ends there, and the run's reward
functions score that answer.

Each call is limited: a Python callable runs on a thread that is waited for ``timeout`` seconds (a call still
running then is reported as timed out and left behind: prefer tools that bound themselves, as :class:`PythonSandbox`
does), an exception becomes an ``error:`` reply, and a result is cut to ``max_output_chars``. An unknown tool name, a
malformed call and a call over ``max_calls`` are replies too, never a crash; each counts in ``info["tool_errors"]``.

Shipped tools: :func:`calculator` (arithmetic, evaluated from the syntax tree, never with ``eval``) and
:class:`PythonSandbox` (``python``: code in a separate interpreter in a jail, :mod:`align.jail.sandbox`).
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

from align.errors import INIT_KWARGS, AlignConfigError, placed
from align.jail.sandbox import PythonSandbox, network_namespace, python
from align.rollout.envs.chat import Environment, EnvStep, check_messages
from align.rollout.rewards import resolve_import

__all__ = [
    "ToolEnvironment",
    "calculator",
    "PythonSandbox",
    "python",
    "parse_tool_calls",
    "message_tool_calls",
    "ToolCall",
    "network_namespace",
]

_TAG = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_SHORT = re.compile(r"^([A-Za-z_][\w.-]*)\s*\((.*)\)$", re.DOTALL)


class ToolCall(dict):
    """``{"name": str, "arguments": dict}``, or ``{"error": str}`` for a call that could not be read."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls written in ``text`` in the tag format (module docstring), in order. A call whose body is
    neither a JSON ``{"name", "arguments"}`` object nor ``name(argument)`` is returned as ``{"error": ...}``; the
    short form's argument is the raw text between the parentheses, under the key ``""`` (the tool's only
    parameter)."""
    calls = []
    for body in _TAG.findall(text):
        try:
            value = json.loads(body)
        except ValueError:
            short = _SHORT.match(body.strip())
            if short:
                calls.append(ToolCall(name=short.group(1), arguments={"": short.group(2).strip()}))
            else:
                calls.append(
                    ToolCall(
                        error=f"could not read the tool call {body[:80]!r}: expected "
                        '{"name": ..., "arguments": {...}} or name(argument)'
                    )
                )
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(ToolCall(error=f"a tool call needs a string 'name', got {body[:80]!r}"))
            continue
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        if not isinstance(arguments, dict):
            calls.append(
                ToolCall(error=f"the arguments of '{value['name']}' must be an object, got {arguments!r}"[:200])
            )
            continue
        calls.append(ToolCall(name=value["name"], arguments=arguments))
    return calls


def _template_calls(message: dict) -> list[ToolCall] | None:
    """Tool calls that a tokenizer's response template parsed into ``message["tool_calls"]`` (None: none given)."""
    parsed = message.get("tool_calls")
    if not parsed:
        return None
    calls = []
    for call in parsed:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict):
            calls.append(ToolCall(error=f"could not read the tool call {call!r}"[:200]))
            continue
        name, arguments = function.get("name"), function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if isinstance(name, str) and isinstance(arguments, dict):
            calls.append(ToolCall(name=name, arguments=arguments))
        else:
            calls.append(ToolCall(error=f"could not read the tool call {call!r}"[:200]))
    return calls


def message_tool_calls(message: dict) -> list[ToolCall]:
    """The tool calls of an assistant message: those its tokenizer's response template parsed into
    ``tool_calls``, else those written in its text (:func:`parse_tool_calls`)."""
    calls = _template_calls(message)
    return parse_tool_calls(message["content"]) if calls is None else calls


# ----------------------------------------------------------------------------------------------- the calculator

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_MAGNITUDE = 10**30


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return cast("int | float", node.value)  # its type() is checked above
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise ValueError("exponent too large")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex) or abs(value) > _MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return value
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, for example "(37 * 48) + 5".
    """
    text = str(expression).strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    text = text.rstrip("=").strip()
    if not text or len(text) > 200:
        raise ValueError("expected an expression of 1 to 200 characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {text!r}") from None
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("result out of range")
        if value.is_integer():
            return str(int(value))
        return repr(round(value, 10))
    return str(value)


# ----------------------------------------------------------------------------------------------- the environment


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _describe(name: str, fn: Callable) -> str:
    """``name(param: type, ...): first docstring line`` for the system prompt."""
    try:
        params = [
            p for p in inspect.signature(fn).parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    # cast: mypy takes a Callable's __call__ for a non-callable attribute
    doc = inspect.getdoc(cast(Any, fn).__call__ if not inspect.isroutine(fn) and callable(fn) else fn) or ""
    shown = ", ".join(
        p.name
        + (
            f": {p.annotation.__name__}"
            if isinstance(p.annotation, type)
            else (f": {p.annotation}" if p.annotation is not inspect.Parameter.empty else "")
        )
        for p in params
    )
    return f"- {name}({shown}): {doc.splitlines()[0] if doc else 'no description'}"


class ToolEnvironment(Environment):
    """Runs the tools a policy calls (module docstring); a turn without a call ends the episode.

    ``reset`` adds a system message that lists the tools and the call format (``system_prompt`` replaces it; a
    row's own system message comes first), then the demonstration ``examples``. ``step`` answers every call of the turn
    with one ``result_role`` message. The environment gives no reward of its own, except ``error_reward`` per failed
    call (0 by default): the run's reward functions score the final answer. ``info``: ``tool_calls`` and
    ``tool_errors``.
    """

    def __init__(
        self,
        tools: Sequence[str | dict] = ("align.rollout.envs.tools.calculator",),
        system_prompt: str | None = None,
        examples: Sequence[dict] | None = None,
        result_role: str = "tool",
        max_calls: int = 4,
        timeout: float = 10.0,
        max_output_chars: int = 1000,
        error_reward: float = 0.0,
    ):
        """
        Args:
            tools: Import paths of the tools (functions or callable objects; a class is built with no arguments),
                or ``{path, name, init_kwargs}``. A tool's name is its function name unless ``name`` is given.
            system_prompt: The system message; null: one generated from the tools' signatures and docstrings.
            examples: Demonstration messages placed after the system message and before the row's own (a question,
                an assistant turn with a call, the tool's result, the final answer): small models follow a shown
                exchange far more often than a described one.
            result_role: Role of the messages that carry results (``user`` for a chat template without ``tool``).
            max_calls: Calls run per turn; further calls are answered with an error.
            timeout: Seconds a call may run before it is reported as timed out.
            max_output_chars: A result longer than this is cut (and says so).
            error_reward: Reward of each failed call (an unknown tool, a malformed call, an exception, a timeout).
        """
        for key, value, ok, expected in (
            ("max_calls", max_calls, _integer(max_calls) and max_calls >= 1, "an integer >= 1"),
            ("timeout", timeout, _number(timeout) and timeout > 0, "a number of seconds > 0"),
            (
                "max_output_chars",
                max_output_chars,
                _integer(max_output_chars) and max_output_chars >= 1,
                "an integer >= 1",
            ),
        ):
            if not ok:
                raise AlignConfigError(f"{INIT_KWARGS}.{key}: expected {expected}, got {value!r}")
        self.tools: dict[str, Callable] = {}
        for i, entry in enumerate(tools):
            spec: dict[str, Any] = dict(entry) if isinstance(entry, dict) else {"path": entry}
            where = f"{INIT_KWARGS}.tools[{i}]"
            target = resolve_import(spec.get("path"), what="tool")
            if isinstance(target, type):
                try:
                    target = target(**spec.get("init_kwargs", {}))
                except AlignConfigError as err:
                    raise placed(err, where) from None
            elif spec.get("init_kwargs"):
                raise AlignConfigError(
                    f"{where}.init_kwargs: expected null for a {type(target).__name__} (init_kwargs "
                    f"build a class), got {spec['init_kwargs']}"
                )
            if not callable(target):
                raise AlignConfigError(
                    f"{where}.path: expected a callable, got '{spec.get('path')}', which resolves "
                    f"to a {type(target).__name__}"
                )
            name = spec.get("name", "") or getattr(target, "__name__", type(target).__name__)
            if name in self.tools:
                raise AlignConfigError(
                    f"{where}.name: expected a name no other tool has, got '{name}'; set 'name' on one of them"
                )
            self.tools[name] = target
            if isinstance(target, PythonSandbox):
                try:
                    target.prepare()  # its jail is found now, not inside the first call's time limit
                except AlignConfigError as err:  # its jail setting (init_kwargs.jail) when built here, else its own
                    raise (
                        placed(err, where)
                        if isinstance(entry, dict) and "init_kwargs" in entry
                        else AlignConfigError(f"{where}: {str(err).removeprefix(f'{INIT_KWARGS}.jail: ')}")
                    ) from None
        self.system_prompt = system_prompt if system_prompt is not None else self.default_system_prompt()
        try:
            self.examples = [dict(m) for m in check_messages(list(examples or []), "examples", allow_empty=True)]
        except ValueError as err:
            raise AlignConfigError(f"{INIT_KWARGS}.examples: {err}") from None
        self.result_role, self.max_calls, self.timeout = result_role, max_calls, timeout
        self.max_output_chars, self.error_reward = max_output_chars, error_reward

    def default_system_prompt(self) -> str:
        lines = "\n".join(_describe(name, fn) for name, fn in self.tools.items())
        first = next(iter(self.tools), "tool")
        return (
            "You can call tools. To call one, write\n"
            f'<tool_call>{{"name": "{first}", "arguments": {{...}}}}</tool_call>\n'
            "and its result comes back in the next message. Tools:\n"
            f"{lines}\n"
            "When you know the answer, reply with it and no tool call."
        )

    def reset(self, row: dict) -> list[dict]:
        messages = [dict(m) for m in row["messages"]]
        system = []
        if messages and messages[0]["role"] == "system":
            system = [messages.pop(0)]
            if self.system_prompt:
                system[0]["content"] = system[0]["content"] + "\n\n" + self.system_prompt
        elif self.system_prompt:
            system = [{"role": "system", "content": self.system_prompt}]
        return [*system, *(dict(m) for m in self.examples), *messages]

    def step(self, message: dict) -> EnvStep:
        calls = message_tool_calls(message)
        if not calls:
            return EnvStep([], 0.0, True, {"tool_calls": 0, "tool_errors": 0})
        replies, errors = [], 0
        for k, call in enumerate(calls):
            if k >= self.max_calls:
                result, ok = f"error: at most {self.max_calls} tool calls per turn", False
            elif "error" in call:
                result, ok = f"error: {call['error']}", False
            else:
                result, ok = self.run(call["name"], call["arguments"])
            errors += not ok
            replies.append({"role": self.result_role, "content": result})
        return EnvStep(replies, self.error_reward * errors, False, {"tool_calls": len(calls), "tool_errors": errors})

    def run(self, name: str, arguments: dict) -> tuple[str, bool]:
        """One call: ``(reply text, succeeded)``. Never raises."""
        fn = self.tools.get(name)
        if fn is None:
            return f"error: unknown tool '{name}'; the tools are {', '.join(self.tools)}", False
        if set(arguments) == {""} and not arguments[""]:  # the short form with nothing between the parentheses
            arguments = {}
        elif set(arguments) == {""}:  # the short form: its text is the one parameter
            try:
                first = next(iter(inspect.signature(fn).parameters))
            except (StopIteration, TypeError, ValueError):
                return f"error: '{name}' takes no argument", False
            arguments = {first: arguments[""]}
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn(**arguments)
            except BaseException as err:  # noqa: BLE001 - a tool's failure is the model's reply
                box["error"] = err

        worker = threading.Thread(target=target, name=f"align-tool-{name}", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            return f"error: '{name}' did not finish within {self.timeout:g} s", False
        if "error" in box:
            err = box["error"]
            text = " ".join(str(err).split())
            return self._cap(
                f"error: {type(err).__name__}: {text}"
                if not isinstance(err, (ValueError, RuntimeError, TimeoutError))
                else f"error: {text}"
            ), False
        return self._cap(str(box.get("value"))), True

    def _cap(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[: self.max_output_chars] + f"\n... [cut: {len(text)} characters in all]"

"""verifiers environments played as align environments (docs/environments.md, "verifiers").

The classic verifiers API (``verifiers`` 0.2 at the top level, 0.3's ``verifiers.legacy``): a ``MultiTurnEnv``
(``SingleTurnEnv``, ``ToolEnv`` and the environments of its hub are ones) plays a rollout by asking a client for
each model turn, answering with ``env_response``, stopping when one of its stop conditions holds
(``is_completed``: its ``max_turns``, a ``ToolEnv`` turn without a tool call, ...), and its ``Rubric`` scores the
finished rollout. :class:`VerifiersEnvironment` runs that rollout in this process, on align's shared event loop,
with a stand-in client whose every "model call" is a turn the policy samples in align's episode loop:

* **reset(row)** starts the rollout on the row: its conversation is the prompt (the environment's system prompt
  and few-shot examples added as verifiers adds them to its own dataset, and, for an environment with tools, the
  tool list and align's tool-call format in the system message), ``answer``, ``info`` and ``task`` come from the
  row's columns of those names (``info_columns`` adds other columns to ``info``), ``example_id`` from its
  ``example_id`` column (else 0). The first messages are
  the prompt the rollout asks the client about.
* **step(message)** gives the rollout the policy's turn (its tool calls read from align's ``<tool_call>`` format
  or the tokenizer's parsed ``tool_calls``) and waits: for the next model call (its new messages, the
  environment's answer, are the reply; reward 0), or for the rollout's end, when the rubric's score of the whole
  rollout is the turn's reward and the episode is done. The rubric's other metrics are summed per episode into
  ``info`` (logged as ``rollout/vf_<name>``).

An episode align cuts first (``max_turns``, ``max_tokens``) is never scored: keep the verifiers environment's own
``max_turns`` within align's. Rubrics with group reward functions (scores of a group together) are refused.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import importlib.util
import json
import logging
import queue
import threading
import time
import uuid
from types import ModuleType
from typing import Any

from align.errors import INIT_KWARGS, AlignConfigError
from align.rollout.envs import loop
from align.rollout.envs.chat import Environment, EnvStep
from align.rollout.envs.tools import message_tool_calls
from align.rollout.rewards import resolve_import

__all__ = ["VerifiersEnvironment", "classic_verifiers", "tools_prompt"]

log = logging.getLogger(__name__)
_ENVS: dict[str, Any] = {}
_ENVS_LOCK = threading.Lock()
_WARNED: set[str] = set()


def classic_verifiers() -> ModuleType:
    """The module of verifiers' classic API: ``verifiers.legacy`` (0.3) or ``verifiers`` itself (0.2)."""
    try:
        name = "verifiers.legacy" if importlib.util.find_spec("verifiers.legacy") is not None else "verifiers"
        return importlib.import_module(name)
    except ImportError as err:
        raise AlignConfigError(
            f"VerifiersEnvironment needs the verifiers package: pip install 'align[verifiers]' ({err})"
        ) from None


def tools_prompt(tools: list) -> str:
    """The system-message text that lists verifiers tools (``name``, ``description``, JSON-schema ``parameters``)
    and align's tool-call format."""
    lines = []
    for tool in tools:
        props = (tool.parameters or {}).get("properties", {})
        params = ", ".join(f"{n}: {p.get('type', 'any')}" for n, p in props.items())
        lines.append(f"- {tool.name}({params}): {(tool.description or 'no description').splitlines()[0]}")
    first = tools[0].name
    return (
        "You can call tools. To call one, write\n"
        f'<tool_call>{{"name": "{first}", "arguments": {{...}}}}</tool_call>\n'
        "and its result comes back in the next message. Tools:\n"
        + "\n".join(lines)
        + "\nWhen you know the answer, reply with it and no tool call."
    )


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [p.get("text", "") if isinstance(p, dict) else getattr(p, "text", "") for p in content]
    return "".join(p for p in parts if p)


_CLIENT_CLASSES: dict[str, type] = {}


def _client(vf) -> Any:
    """A new stand-in client: the model a verifiers rollout talks to. Each model call hands the prompt to align's
    thread (``turns``) and waits for the turn the policy sampled (``pending``, completed from that thread)."""
    if vf.__name__ not in _CLIENT_CLASSES:

        class AlignPolicyClient(vf.Client):
            def __init__(self):
                super().__init__(None)
                self.turns: queue.SimpleQueue = queue.SimpleQueue()  # ("turn", prompt) | ("end", state) | ("error", e)
                self.pending = None  # the asyncio future of the turn the rollout waits for
                self.count = 0

            async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
                import asyncio

                self.pending = asyncio.get_running_loop().create_future()
                self.turns.put(("turn", list(prompt)))
                return await self.pending

            def setup_client(self, config):
                raise NotImplementedError("align's stand-in client has no endpoint")

            async def get_native_response(self, *args, **kwargs):
                raise NotImplementedError("align's stand-in client answers get_response only")

            async def to_native_tool(self, tool):
                return tool

            async def to_native_prompt(self, messages):
                return messages, {}

            async def raise_from_native_response(self, response):
                return None

            async def from_native_response(self, response):
                return response

            async def close(self):
                return None

        _CLIENT_CLASSES[vf.__name__] = AlignPolicyClient
    return _CLIENT_CLASSES[vf.__name__]()


def _load(env_id: str | None, path: str | None, env_args: dict, vf) -> Any:
    key = json.dumps([env_id, path, env_args], sort_keys=True, default=repr)
    with _ENVS_LOCK:
        if key not in _ENVS:
            what = f"verifiers environment '{env_id or path}'"
            try:
                if env_id is not None:
                    env = vf.load_environment(env_id, **env_args)
                else:
                    env = resolve_import(path, what="verifiers environment")(**env_args)
            except AlignConfigError:
                raise
            except Exception as err:  # noqa: BLE001 - user code; re-raised on one line
                raise AlignConfigError(
                    f"{what}: cannot build it from env_args {env_args}: {type(err).__name__}: "
                    f"{' '.join(str(err).split())[:300]}"
                ) from err
            if not isinstance(env, vf.MultiTurnEnv):
                raise AlignConfigError(
                    f"{what}: expected a verifiers MultiTurnEnv (SingleTurnEnv, ToolEnv, ...) of "
                    f"the classic API, got {type(env).__name__}"
                )
            if env.rubric.has_group_rewards:
                raise AlignConfigError(
                    f"{what}: its rubric has group reward functions; align scores each episode "
                    "alone (GRPO compares the group itself)"
                )
            _ENVS[key] = env
        return _ENVS[key]


class VerifiersEnvironment(Environment):
    """A verifiers environment (classic API) as an align environment (module docstring). Every instance with the
    same settings shares one verifiers environment object; each holds its own rollout."""

    def __init__(
        self,
        path: str | None = None,
        env_id: str | None = None,
        env_args: dict | None = None,
        info_columns: list[str] | None = None,
        roles: dict | None = None,
        tool_prompt: bool = True,
        timeout: float = 300.0,
    ):
        """
        Args:
            path: Import path of a function or class that returns the verifiers environment
                (``my_env.py:load_environment``), called with ``env_args``.
            env_id: Instead of ``path``: an installed verifiers environment (``vf-install``), loaded with verifiers'
                ``load_environment(env_id, **env_args)``.
            env_args: Arguments of the environment's loader.
            info_columns: Row columns added to the rollout's ``info`` (beside a row's own ``info`` column).
            roles: Roles renamed in the environment's messages, ``{tool: user}`` for a chat template without a
                ``tool`` role.
            tool_prompt: For an environment with tools, add the tool list and align's tool-call format to the
                system message (align's chat templates are not given ``tools=``).
            timeout: Seconds to wait for the environment's answer to a turn.
        """
        if (path is None) == (env_id is None):
            raise AlignConfigError(
                f"{INIT_KWARGS}: expected exactly one of path (an import path of the environment's "
                f"loader) and env_id (an installed environment), got path={path!r}, "
                f"env_id={env_id!r}"
            )
        self.vf = classic_verifiers()
        self.types = importlib.import_module(self.vf.__name__ + ".types")
        self.env = _load(env_id, path, dict(env_args or {}), self.vf)
        name = env_id or path
        assert name is not None  # exactly one of them is given (checked above)
        self.name = name
        self.info_columns, self.roles = list(info_columns or []), dict(roles or {})
        self.tool_prompt, self.timeout = tool_prompt, timeout
        self.client: Any = None  # the episode's AlignPolicyClient (a class made per verifiers module)
        self.running: concurrent.futures.Future[None] | None = None  # the episode's rollout on the shared loop
        self.context: list = []

    def _prompt(self, row: dict) -> list[dict]:
        messages = [dict(m) for m in row["messages"]]
        system = messages.pop(0) if messages and messages[0]["role"] == "system" else None
        if system is None and self.env.system_prompt:
            system = {"role": "system", "content": self.env.system_prompt}
        tools = self.env.tool_defs or []
        if tools and self.tool_prompt:
            text = tools_prompt(tools)
            system = {"role": "system", "content": f"{system['content']}\n\n{text}" if system else text}
        few_shot = [dict(m) for m in (self.env.few_shot or [])] if len(messages) == 1 else []
        return [*([system] if system else []), *few_shot, *messages]

    def reset(self, row: dict) -> list[dict]:
        self._abandon()
        rollout_input = {"prompt": self._prompt(row), "example_id": int(row.get("example_id", 0))}
        for key in ("answer", "task"):
            if key in row:
                rollout_input[key] = str(row[key])
        missing = [c for c in self.info_columns if c not in row]
        if missing:
            raise KeyError(f"info_columns {missing} are not columns of the row (columns: {sorted(row)})")
        info = {**(row.get("info") or {}), **{c: row[c] for c in self.info_columns}}
        if info or "info" in row:
            rollout_input["info"] = info
        self.client = _client(self.vf)
        self.running = loop.submit(self._play(rollout_input, self.client))
        kind, value = self._next()
        if kind != "turn":
            raise RuntimeError(f"the rollout ended before the policy's first turn ({self._why(value)})")
        self.context = value
        return [self._message(m) for m in value]

    async def _play(self, rollout_input: dict, client) -> None:
        """The rollout, then the rubric's score (as verifiers scores one rollout), reported to align's thread."""
        env = self.env
        try:
            state = await env.rollout(rollout_input, client, "align", {})
            if env.score_rollouts:
                await env.rubric.score_rollout(state)
            else:
                await env.rubric.dummy_score_rollout(state)
            await env.rubric.cleanup(state)
            client.turns.put(("end", state))
        except Exception as err:  # noqa: BLE001 - reported to the thread that waits, raised there
            client.turns.put(("error", err))

    def _next(self) -> tuple[str, Any]:
        try:
            kind, value = self.client.turns.get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError(f"the verifiers environment did not answer within timeout={self.timeout:g} s") from None
        if kind == "error":
            raise value
        return kind, value

    def _abandon(self) -> None:
        """Cancel the rollout of the previous episode if align cut it before verifiers ended it."""
        if self.running is not None and not self.running.done():
            self.running.cancel()
            if self.name not in _WARNED:
                _WARNED.add(self.name)
                log.warning(
                    "verifiers environment '%s': align ended an episode (max_turns or max_tokens) before "
                    "the environment did, so its rubric did not score it (reward 0); keep the environment's "
                    "own max_turns within model.environment.max_turns",
                    self.name,
                )
        self.running = None

    def _why(self, state: Any) -> str:
        error = state.get("error") if hasattr(state, "get") else None
        return f"error: {error!r}" if error is not None else f"stop condition {state.get('stop_condition')!r}"

    def _message(self, message: Any) -> dict:
        role = message["role"] if isinstance(message, dict) else message.role
        content = message["content"] if isinstance(message, dict) else message.content
        return {"role": self.roles.get(role, role), "content": _text(content)}

    def _response(self, message: dict) -> Any:
        t = self.types
        self.client.count += 1
        calls = [c for c in message_tool_calls(message) if "error" not in c] if self.env.tool_defs else []
        tool_calls = [
            t.ToolCall(id=f"call_{self.client.count}_{k}", name=c["name"], arguments=json.dumps(c["arguments"]))
            for k, c in enumerate(calls)
        ] or None
        reply = t.ResponseMessage(
            content=message["content"],
            tool_calls=tool_calls,
            is_truncated=False,
            finish_reason="tool_calls" if tool_calls else "stop",
        )
        return t.Response(id=f"align-{uuid.uuid4().hex}", created=int(time.time()), model="align", message=reply)

    def step(self, message: dict) -> EnvStep:
        if self.client is None or self.client.pending is None or self.client.pending.done():
            raise RuntimeError("step without a running rollout; call reset first")
        loop.call_soon(self.client.pending.set_result, self._response(message))
        kind, value = self._next()
        if kind == "turn":
            seen = len(self.context) + 1  # the previous prompt and the policy's turn
            new, self.context = value[seen:], value
            return EnvStep([self._message(m) for m in new], 0.0, False, {})
        self.running = None
        info = {
            f"vf_{k}": float(v)
            for k, v in (value.get("metrics") or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        info["vf_errors"] = float(value.get("error") is not None)
        return EnvStep([], float(value.get("reward") or 0.0), True, info)

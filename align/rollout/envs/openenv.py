"""OpenEnv environments played as align environments (docs/environments.md, "OpenEnv").

An OpenEnv environment (the ``openenv`` package) is a class with ``reset(seed=None, episode_id=None, **kwargs)``,
``step(action)`` and ``state``, whose actions and observations are pydantic models. :class:`OpenEnvEnvironment`
plays one either in this process (``env_class``: its import path, built with ``init_kwargs``) or on a running
OpenEnv server (``url``: OpenEnv's own generic client, one WebSocket session per episode slot), and maps it onto
align's ``reset(row)`` / ``step(message)``:

* **reset**: the row's columns named in ``reset_columns`` (default: ``seed`` where the row has one) are passed to
  the environment's ``reset``; the episode's first messages are the row's system message and the reset
  observation's text as a user message (``prompt: observation``), the row's own conversation (``prompt: row``), or
  the row's conversation with the observation's text appended to its last message (``prompt: both``).
* **step**: the policy's reply becomes the action: its text in one field (``action_field``, found by itself when
  the action has one text field), or the keyword arguments that ``action_parser`` reads from it (``json``: the
  first JSON object of the reply; ``tool_call``: the arguments of its first tool call, in align's tool-call
  format; or the import path of a function ``text -> dict``). A reply that gives no valid action is answered with
  ``error: ...`` and ``invalid_action_reward``, and counted in ``info["invalid_actions"]``; the episode goes on.
* the observation's reward (None: 0) is the turn's reward and its ``done`` ends the episode; otherwise its text
  (``observation_field``, found by itself when the observation has one text field, else every field as
  ``name: value`` lines) is the next ``observation_role`` message. align's ``max_turns`` and ``max_tokens`` cut
  an episode the environment has not ended (truncated).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import typing
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

from align.errors import INIT_KWARGS, AlignConfigError
from align.rollout.envs import loop
from align.rollout.envs.chat import Environment, EnvStep
from align.rollout.envs.tools import message_tool_calls
from align.rollout.rewards import resolve_import

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = [
    "OpenEnvEnvironment",
    "text_fields",
    "read_action",
    "observation_text",
    "check_fields",
    "InvalidAction",
    "declared_classes",
]

_BASE_FIELDS = {"metadata", "reward", "done"}  # what every OpenEnv Action/Observation has besides its own fields
_PROMPTS = ("observation", "row", "both")


class InvalidAction(ValueError):
    """A reply that gives no valid action: answered with ``error: ...``, not raised."""


def _openenv():
    try:
        from openenv.core import env_server
    except ImportError as err:
        raise AlignConfigError(
            f"OpenEnvEnvironment needs the openenv package: pip install 'align[openenv]' ({err})"
        ) from None
    return env_server


def text_fields(schema: dict) -> list[str]:
    """The string-typed fields of a JSON schema (an action's or an observation's), without the base fields."""
    out = []
    for name, prop in (schema.get("properties") or {}).items():
        kinds = [prop.get("type")] + [p.get("type") for p in prop.get("anyOf", [])]
        if name not in _BASE_FIELDS and "string" in kinds:
            out.append(name)
    return out


def _own_fields(schema: dict) -> list[str]:
    return [n for n in (schema.get("properties") or {}) if n not in _BASE_FIELDS]


def _first_json_object(text: str) -> dict:
    decoder = json.JSONDecoder()
    for start in (i for i, c in enumerate(text) if c == "{"):
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    raise InvalidAction('expected a JSON object ({"field": value, ...}) in the reply')


def read_action(message: dict, field: str | None, parser: str | Callable | None) -> dict:
    """The action's keyword arguments read from the policy's message (module docstring), or InvalidAction."""
    text = message["content"]
    if parser is None:
        return {field: text}
    if parser == "json":
        return _first_json_object(text)
    if parser == "tool_call":
        calls = message_tool_calls(message)
        if not calls:
            raise InvalidAction('expected a tool call <tool_call>{"name": ..., "arguments": {...}}</tool_call>')
        if "error" in calls[0]:
            raise InvalidAction(calls[0]["error"])
        return dict(calls[0]["arguments"])
    assert callable(parser)  # any other name was resolved to its callable (OpenEnvEnvironment)
    try:
        value = parser(text)
    except ValueError as err:  # the parser's way to say the reply holds no action
        raise InvalidAction(" ".join(str(err).split())[:300] or type(err).__name__) from None
    if not isinstance(value, dict):
        raise InvalidAction(f"the action parser returned a {type(value).__name__}, not a dict of action fields")
    return value


def observation_text(observation: dict, field: str | None) -> str:
    """The text of an observation's fields (``observation_field``'s value, else every own field as
    ``name: value`` lines; a single text field alone)."""
    own = {k: v for k, v in observation.items() if k not in _BASE_FIELDS}
    if field is not None:
        value = own[field]
        return value if isinstance(value, str) else json.dumps(value)
    texts = [k for k, v in own.items() if isinstance(v, str)]
    if len(texts) == 1 and len(own) == 1:
        return own[texts[0]]
    return "\n".join(f"{k}: {v if isinstance(v, str) else json.dumps(v)}" for k, v in own.items())


def _reward(value: Any) -> float:
    if value is None:
        return 0.0
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"the observation's reward must be finite, got {reward}")
    return reward


def _accepted(fn: Callable, kwargs: dict) -> dict:
    """``kwargs`` that ``fn`` accepts (all of them when it takes ``**kwargs``), as OpenEnv's server filters them."""
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def declared_classes(env_cls: type) -> tuple[type, type] | None:
    """The Action and Observation classes an OpenEnv environment class declares
    (``Environment[MyAction, MyObservation, MyState]``), or None."""
    base = _openenv().Environment
    for klass in env_cls.__mro__:
        for orig in klass.__dict__.get("__orig_bases__", ()):
            origin, args = typing.get_origin(orig), typing.get_args(orig)
            if (
                isinstance(origin, type)
                and issubclass(origin, base)
                and len(args) >= 2
                and all(isinstance(a, type) for a in args[:2])
            ):
                return args[0], args[1]
    return None


def check_fields(action: dict, schema: dict) -> None:
    """InvalidAction naming the fields an action lacks or should not have, by its JSON schema (a server's own
    rejection does not say which)."""
    fields = set(schema.get("properties") or {})
    missing = [f for f in schema.get("required", []) if f not in action]
    unknown = [f for f in action if f not in fields] if schema.get("additionalProperties") is False else []
    if missing or unknown:
        said = [f"missing {missing}"] * bool(missing) + [f"unknown {unknown}"] * bool(unknown)
        raise InvalidAction(f"not a valid action: fields {', '.join(said)} (its fields: {sorted(fields)})")


class _Local:
    """An OpenEnv environment instance in this process."""

    def __init__(self, env_cls: type, init_kwargs: dict, action_cls: type):
        self.env, self.action_cls = env_cls(**init_kwargs), action_cls
        self.serialize = _openenv().serialize_observation
        # An environment that must stay on one thread gets its own; align calls it from several otherwise.
        self.executor = ThreadPoolExecutor(1) if getattr(env_cls, "REQUIRES_SINGLE_THREAD_EXECUTOR", False) else None

    def _call(self, fn, *args, **kwargs):
        if self.executor is None:
            return fn(*args, **kwargs)
        return self.executor.submit(fn, *args, **kwargs).result()

    def reset(self, kwargs: dict) -> dict:
        return self.serialize(self._call(self.env.reset, **_accepted(self.env.reset, kwargs)))

    def step(self, action: dict) -> dict:
        from pydantic import ValidationError

        try:
            parsed = self.action_cls(**action)
        except ValidationError as err:
            raise InvalidAction(f"not a valid {self.action_cls.__name__}: {_validation_text(err)}") from None
        return self.serialize(self._call(self.env.step, parsed))

    def close(self) -> None:
        self.env.close()


def _validation_text(err) -> str:
    return "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'action'}: {e['msg']}" for e in err.errors())[:300]


class _Remote:
    """One session (a WebSocket) on a running OpenEnv server, through OpenEnv's generic client."""

    def __init__(self, url: str, timeout: float, headers: dict | None, action_schema: dict):
        from openenv.core import GenericEnvClient

        kwargs = {"headers": headers} if headers else {}
        self.client = GenericEnvClient(base_url=url, message_timeout_s=timeout, **kwargs)
        self.timeout, self.connected, self.action_schema = timeout, False, action_schema

    async def _reset(self, kwargs: dict) -> dict:
        if not self.connected:
            await self.client.connect()
            self.connected = True
        return _result(await self.client.reset(**kwargs))

    async def _step(self, action: dict) -> dict:
        try:
            return _result(await self.client.step(action))
        except RuntimeError as err:  # the server's error reply: a rejected action is the model's mistake
            if "VALIDATION_ERROR" in str(err):
                raise InvalidAction(" ".join(str(err).split())[:300]) from None
            raise

    def reset(self, kwargs: dict) -> dict:
        return loop.run(self._reset(kwargs), self.timeout)

    def step(self, action: dict) -> dict:
        check_fields(action, self.action_schema)
        return loop.run(self._step(action), self.timeout)

    async def _close(self) -> None:
        await self.client.close()  # called inside the loop: openenv 0.10's client runs it synchronously elsewhere

    def close(self) -> None:
        if self.connected:
            loop.run(self._close(), self.timeout)
            self.connected = False


def _result(result) -> dict:
    return {"observation": result.observation, "reward": result.reward, "done": result.done}


def _schema(url: str, timeout: float, headers: dict | None) -> dict:
    request = urllib.request.Request(url.rstrip("/") + "/schema", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except (OSError, ValueError) as err:
        raise AlignConfigError(
            f"{INIT_KWARGS}.url: expected a running OpenEnv server, got {url!r}, whose schema at "
            f"{url}/schema cannot be read ({type(err).__name__}: {err}); is the server running?"
        ) from None


class OpenEnvEnvironment(Environment):
    """An OpenEnv environment, in-process or served, as an align environment (module docstring)."""

    def __init__(
        self,
        env_class: str | type | None = None,
        init_kwargs: dict | None = None,
        url: str | None = None,
        action_field: str | None = None,
        action_parser: str | Callable | None = None,
        observation_field: str | None = None,
        observation_role: str = "user",
        prompt: str = "observation",
        reset_columns: Sequence[str] | None = None,
        invalid_action_reward: float = 0.0,
        timeout: float = 60.0,
        token_env: str | None = None,
    ):
        """
        Args:
            env_class: Import path of an OpenEnv ``Environment`` subclass (``my_envs.py:Game``) played in this
                process; one instance per episode slot.
            init_kwargs: Arguments of ``env_class``'s constructor.
            url: Base URL of a running OpenEnv server (``http://localhost:8000``) instead of ``env_class``. Each
                episode slot holds one session, so the server's ``max_concurrent_envs`` must be at least the
                episodes of a rollout (batch size x group size).
            action_field: The action field that receives the reply's text; null: the action's only text field.
            action_parser: Instead of ``action_field``: ``json``, ``tool_call``, or the import path of a function
                ``text -> dict`` of action fields (raising ValueError for a reply that holds no action).
            observation_field: The observation field shown to the policy; null: the only text field, else every
                field as ``name: value`` lines.
            observation_role: Role of the messages that carry observations.
            prompt: The first messages: ``observation`` (the reset observation, after the row's system message),
                ``row`` (the row's conversation), or ``both`` (the observation appended to the row's last message).
            reset_columns: Row columns passed to ``reset`` as keyword arguments; null: ``seed`` when the row has
                one. A listed column missing from a row is an error.
            invalid_action_reward: Reward of a reply that gives no valid action.
            timeout: Seconds a server may take to answer (``url``).
            token_env: Name of an environment variable holding a bearer token for the server (a private hosted
                environment); the token itself never goes in a config.
        """
        if (env_class is None) == (url is None):
            raise AlignConfigError(
                f"{INIT_KWARGS}: expected exactly one of env_class (an environment played in this "
                f"process) and url (a running OpenEnv server), got env_class={env_class!r}, "
                f"url={url!r}"
            )
        if prompt not in _PROMPTS:
            raise AlignConfigError(f"{INIT_KWARGS}.prompt: expected one of {', '.join(_PROMPTS)}, got {prompt!r}")
        if action_field is not None and action_parser is not None:
            raise AlignConfigError(
                f"{INIT_KWARGS}.action_parser: expected null with action_field set (set one of "
                f"them, not both), got {action_parser!r}"
            )
        env_server = _openenv()
        headers = None
        if token_env is not None:
            if not os.environ.get(token_env):
                raise AlignConfigError(
                    f"{INIT_KWARGS}.token_env: expected a set environment variable, got {token_env!r}, which is not set"
                )
            headers = {"Authorization": f"Bearer {os.environ[token_env]}"}
        self.where = f"OpenEnvEnvironment({url or getattr(env_class, '__name__', env_class)})"
        if init_kwargs and url is not None:
            raise AlignConfigError(
                f"{INIT_KWARGS}.init_kwargs: expected null with url (a server builds its own "
                f"environments; init_kwargs are for env_class), got {init_kwargs}"
            )
        if url is not None:
            schemas = _schema(url, timeout, headers)
            action_schema, observation_schema = schemas.get("action", {}), schemas.get("observation", {})
            self.backend: _Local | _Remote = _Remote(url, timeout, headers, action_schema)
        else:
            cls = resolve_import(env_class, what="OpenEnv environment")
            if not (isinstance(cls, type) and issubclass(cls, env_server.Environment)):
                raise AlignConfigError(
                    f"{INIT_KWARGS}.env_class: expected a subclass of openenv's Environment, got {cls!r}"
                )
            declared = declared_classes(cls)
            if declared is None:
                raise AlignConfigError(
                    f"{INIT_KWARGS}.env_class: expected an Environment that declares its Action and "
                    f"Observation classes (Environment[MyAction, MyObservation, MyState]), got "
                    f"{cls!r}, which does not"
                )
            self.backend = _Local(cls, dict(init_kwargs or {}), declared[0])
            # Environment's type parameters are bound to openenv's Action and Observation: pydantic models.
            action_schema, observation_schema = (cast("type[BaseModel]", c).model_json_schema() for c in declared)
        self.parser = (
            action_parser
            if action_parser in (None, "json", "tool_call")
            else resolve_import(action_parser, what="action parser")
        )
        if action_parser is None:
            texts = text_fields(action_schema)
            if action_field is None and len(texts) != 1:
                raise AlignConfigError(
                    f"{INIT_KWARGS}.action_field: expected the action's text field to fill, got "
                    f"null, and the action has {len(texts)} text fields ({texts}); set "
                    "action_field or action_parser"
                )
            action_field = action_field or texts[0]
            if action_field not in _own_fields(action_schema):
                raise AlignConfigError(
                    f"{INIT_KWARGS}.action_field: expected a field of the action (fields: "
                    f"{_own_fields(action_schema)}), got {action_field!r}"
                )
        own = _own_fields(observation_schema)
        if observation_field is not None and own and observation_field not in own:
            raise AlignConfigError(
                f"{INIT_KWARGS}.observation_field: expected a field of the observation (fields: "
                f"{own}), got {observation_field!r}"
            )
        self.action_field, self.observation_field, self.observation_role = (
            action_field,
            observation_field,
            observation_role,
        )
        self.prompt, self.reset_columns = prompt, None if reset_columns is None else list(reset_columns)
        self.invalid_action_reward = float(invalid_action_reward)

    def reset(self, row: dict) -> list[dict]:
        if self.reset_columns is None:
            kwargs = {"seed": row["seed"]} if "seed" in row else {}
        else:
            missing = [c for c in self.reset_columns if c not in row]
            if missing:
                raise KeyError(f"reset_columns {missing} are not columns of the row (columns: {sorted(row)})")
            kwargs = {c: row[c] for c in self.reset_columns}
        first = self.backend.reset(kwargs)
        messages = [dict(m) for m in row["messages"]]
        if self.prompt == "row":
            return messages
        text = self._text(first["observation"])
        if self.prompt == "both":  # a prompt row's conversation ends with its user message
            messages[-1]["content"] = f"{messages[-1]['content']}\n\n{text}"
            return messages
        system = [m for m in messages[:1] if m["role"] == "system"]
        return [*system, {"role": "user", "content": text}]

    def _text(self, observation: dict) -> str:
        try:
            return observation_text(observation, self.observation_field)
        except KeyError:
            raise ValueError(
                f"observation_field {self.observation_field!r} is not in the observation (fields: "
                f"{sorted(observation)})"
            ) from None

    def step(self, message: dict) -> EnvStep:
        try:
            action = read_action(message, self.action_field, self.parser)
            result = self.backend.step(action)
        except InvalidAction as err:
            reply = {"role": self.observation_role, "content": f"error: {err}"}
            return EnvStep([reply], self.invalid_action_reward, False, {"invalid_actions": 1})
        reward, done = _reward(result["reward"]), bool(result["done"])
        if done:
            return EnvStep([], reward, True, {"invalid_actions": 0})
        reply = {"role": self.observation_role, "content": self._text(result["observation"])}
        return EnvStep([reply], reward, False, {"invalid_actions": 0})

    def close(self) -> None:
        """Close the environment (in-process) or the session (a server)."""
        self.backend.close()

"""Environments for language-model policies: a conversation played over several turns (docs/environments.md).

An environment is a class with two methods, in the spirit of Gymnasium's ``reset``/``step``::

    class GuessTheNumber(Environment):
        def reset(self, row):                    # one prompt row of the data: its columns, 'prompt', 'messages'
            self.secret = int(row["secret"])
            return row["messages"]               # the first messages of the conversation
        def step(self, message):                 # the policy's turn: {"role": "assistant", "content": ...}
            guess = int(message["content"])
            if guess == self.secret:
                return EnvStep([], reward=1.0, done=True)
            hint = "higher" if guess < self.secret else "lower"
            return EnvStep([{"role": "user", "content": hint}])

and is named by import path in YAML, like a reward function (``model.environment.path``). Each episode plays on
an instance of its own; instances are made with ``init_kwargs`` and reused across rollouts, so ``reset`` must
clear everything an earlier episode left. ``step`` returns :class:`EnvStep` (or a plain ``(messages, reward,
done[, info])`` tuple): the environment's reply messages (a tool result, a game state; empty when done), the
reward of the turn just played, whether the episode is over, and ``info``, whose numeric entries are summed per
episode and logged (``tool_calls``, ``tool_errors``, ...).

:class:`EnvironmentPool` makes the instances and calls them, several at a time on worker threads (``workers``),
each call limited to ``step_timeout`` seconds. A call that raises, a reply of the wrong shape and a call that
never returns each stop the run with one :class:`~align.errors.AlignEnvError` line that names the environment, the
episode and the turn. The episode loop itself is :mod:`align.rollout.episodes`.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from align.errors import INIT_KWARGS, AlignConfigError, AlignEnvError, placed
from align.rollout.rewards import error_location, one_line, resolve_import

__all__ = ["EnvStep", "Environment", "EnvironmentSpec", "EnvironmentPool", "CallRecord", "check_messages"]


class EnvStep(NamedTuple):
    """What an environment answers to one assistant turn."""

    messages: list  # reply messages ({role, content} dicts) appended to the conversation; [] when done
    reward: float = 0.0  # reward of the turn just played
    done: bool = False  # the episode is over (no reply is rendered)
    info: dict | None = None  # numeric entries are summed per episode and logged as rollout/<name>


class Environment:
    """Base class of a language-model environment (optional: any class with ``reset`` and ``step`` works)."""

    def reset(self, row: dict) -> list[dict]:
        """The first messages of an episode for the data row ``row`` (its columns, plus ``prompt``, the prompt
        text, and ``messages``, the prompt conversation as the data module built it). Default: ``messages``."""
        return row["messages"]

    def step(self, message: dict) -> EnvStep:
        """Answer the policy's message ``{"role": "assistant", "content": text}``."""
        raise NotImplementedError(f"{type(self).__name__}.step")


@dataclass
class EnvironmentSpec:
    """A multi-turn environment in a run's config (``model.environment``)."""

    path: str
    """Import path of the environment class (or a factory): ``package.module.Class`` or ``file.py:Class`` (in
    Python, the class itself)."""
    init_kwargs: dict = field(default_factory=dict)
    """Arguments of every instance's constructor."""
    max_turns: int = 4
    """Assistant turns per episode; an episode still running after the last is cut off (truncated)."""
    max_tokens: int = 256
    """Token budget of an episode after its prompt: assistant and environment tokens together. A turn is cut where
    the budget runs out, and an environment reply that does not fit ends the episode (truncated)."""
    weight: float = 1.0
    """Weight of the environment's rewards (summed over the episode: the reward part ``env``) in the total."""
    step_timeout: float = 60.0
    """Seconds one ``reset`` or ``step`` call may take; a call still running then stops the run."""
    workers: int = 4
    """Episodes whose environment calls run at the same time (threads); 1 calls them one after another."""

    def __post_init__(self) -> None:
        for key, low in (("max_turns", 1), ("max_tokens", 2), ("workers", 1)):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < low:
                raise AlignConfigError(
                    f"model.environment.{key}: expected an integer >= {low}, got {getattr(self, key)!r}"
                )
        if not (self.step_timeout > 0 and math.isfinite(self.step_timeout)):
            raise AlignConfigError(f"model.environment.step_timeout: expected > 0 seconds, got {self.step_timeout!r}")
        if not math.isfinite(self.weight):
            raise AlignConfigError(f"model.environment.weight: expected a finite number, got {self.weight!r}")


class CallRecord(NamedTuple):
    """One environment call, for the ``env_step`` spans: wall-clock nanoseconds since the epoch."""

    episode: int
    turn: int
    start_ns: int
    end_ns: int
    reward: float
    done: bool
    info: dict


def check_messages(messages: Any, what: str, allow_empty: bool = False) -> list[dict]:
    """``messages`` as a list of ``{role, content}`` dicts with string values, or ValueError saying what is wrong."""
    if isinstance(messages, tuple):
        messages = list(messages)
    if not isinstance(messages, list):
        raise ValueError(f"{what} must be a list of messages, got {_preview(messages)}")
    if not messages and not allow_empty:
        raise ValueError(f"{what} must hold at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{what}[{i}] must be a {{'role': str, 'content': str}} dict, got {_preview(m)}")
    return messages


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_step(value: Any) -> EnvStep:
    """An environment's answer as a checked :class:`EnvStep`, or ValueError saying what is wrong."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(EnvStep._fields))
        if unknown or "messages" not in value:
            raise ValueError(
                f"step must return EnvStep(messages, reward, done, info), got a dict with keys {sorted(value)}"
            )
        value = EnvStep(**value)
    elif isinstance(value, (tuple, list)) and not isinstance(value, EnvStep):
        if len(value) not in (3, 4):
            raise ValueError(
                f"step must return EnvStep(messages, reward, done[, info]), got a sequence of "
                f"{len(value)} items: {_preview(value)}"
            )
        value = EnvStep(*value)
    elif not isinstance(value, EnvStep):
        raise ValueError(f"step must return EnvStep(messages, reward, done[, info]), got {_preview(value)}")
    reward = value.reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) and not hasattr(reward, "__float__"):
        raise ValueError(f"step's reward must be a number, got {_preview(reward)}")
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"step's reward must be finite, got {reward}")
    if value.done not in (True, False):
        raise ValueError(f"step's done must be True or False, got {_preview(value.done)}")
    done = bool(value.done)
    messages = check_messages(value.messages, "step's messages", allow_empty=True)
    if not messages and not done:
        raise ValueError("step's messages are empty but done is False: an episode that goes on needs a reply")
    info = value.info or {}
    if not isinstance(info, dict):
        raise ValueError(f"step's info must be a dict or None, got {_preview(info)}")
    return EnvStep(messages, reward, done, info)


class EnvironmentPool:
    """The environment instances of a run (one per episode slot, made on first use and reused), and the calls to
    them: several at once on daemon threads, each limited to ``spec.step_timeout`` seconds and checked."""

    def __init__(self, spec: EnvironmentSpec | str, setting: str = "model.environment"):
        """``setting``: where ``spec`` is in the config, named by the errors of the environment's own settings."""
        if isinstance(spec, str):
            spec = EnvironmentSpec(path=spec)
        self.spec, self.setting = spec, setting
        self.factory = resolve_import(spec.path, what="environment")
        if not callable(self.factory):
            raise AlignConfigError(
                f"environment '{spec.path}': resolves to a {type(self.factory).__name__}, not a class or factory"
            )
        self.name = getattr(self.factory, "__name__", type(self.factory).__name__)
        self.path = spec.path if isinstance(spec.path, str) else getattr(self.factory, "__qualname__", self.name)
        self.instances: list[Any] = []

    @property
    def where(self) -> str:
        """``environment 'Name' (import path)``: how every message names this environment."""
        return f"environment '{self.name}' ({self.path})"

    def instance(self, slot: int) -> Any:
        while len(self.instances) <= slot:
            try:
                env = self.factory(**self.spec.init_kwargs)
            except Exception as err:  # noqa: BLE001 - user code; re-raised on one line
                if isinstance(err, AlignConfigError) and str(err).startswith(INIT_KWARGS):
                    raise placed(err, self.setting) from None  # one of the environment's own settings, named
                raise AlignConfigError(
                    f"{self.where}: cannot build it from init_kwargs {self.spec.init_kwargs}: "
                    f"{type(err).__name__}: {one_line(err)}{error_location(err, None)}"
                ) from err
            missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
            if missing:
                raise AlignConfigError(
                    f"{self.where}: an environment needs reset(row) and step(message) methods; "
                    f"it has no {' and no '.join(missing)} (see align.rollout.envs.chat.Environment)"
                )
            self.instances.append(env)
        return self.instances[slot]

    def reset(self, rows: Sequence[dict], labels: Sequence[str]) -> list[list[dict]]:
        """``reset(row)`` of instance ``i`` for every ``rows[i]``: each episode's first messages, checked."""
        calls = [(lambda env=self.instance(i), row=row: env.reset(row)) for i, row in enumerate(rows)]
        results = self._run(calls, labels, "reset")
        out = []
        for value, label in zip(results, labels):
            try:
                messages = check_messages(value[0], "reset's result")
                if messages[-1]["role"] == "assistant":
                    raise ValueError("reset's messages must not end with an assistant message (the policy speaks next)")
            except ValueError as err:
                raise AlignEnvError(f"{self.where}: {label}: {err}") from None
            out.append([dict(m) for m in messages])
        return out

    def step(
        self, slots: Sequence[int], messages: Sequence[dict], labels: Sequence[str], turn: int
    ) -> tuple[list[EnvStep], list[CallRecord]]:
        """``step(message)`` of each episode ``slots[i]``: the checked replies and a record of every call."""
        calls = [(lambda env=self.instance(s), m=m: env.step(dict(m))) for s, m in zip(slots, messages)]
        results = self._run(calls, labels, "step", turn)
        steps, records = [], []
        for (value, start, end), slot, label in zip(results, slots, labels):
            try:
                out = _as_step(value)
            except ValueError as err:
                raise AlignEnvError(f"{self.where}: {label}, turn {turn}: {err}") from None
            steps.append(out)
            assert out.info is not None  # _as_step makes a missing info {}
            records.append(CallRecord(slot, turn, start, end, out.reward, out.done, out.info))
        return steps, records

    def _run(
        self,
        calls: Sequence[Callable[..., Any]],  # each called with no arguments (lambdas binding theirs as defaults)
        labels: Sequence[str],
        method: str,
        turn: int | None = None,
    ) -> list[tuple[Any, int, int]]:
        """Run ``calls`` on up to ``spec.workers`` daemon threads: ``[(result, start_ns, end_ns)]`` in order.

        Daemon threads, so that a call that never returns does not keep the process alive after the run has
        stopped on it. The first error (in call order) is raised on one line."""
        n = len(calls)
        results: list[Any] = [None] * n
        started: list[float | None] = [None] * n
        finished = [False] * n
        errors: dict[int, BaseException] = {}
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(n):
            todo.put(i)
        lock = threading.Condition()

        def worker() -> None:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                started[i] = time.monotonic()
                start_ns = time.time_ns()
                try:
                    results[i] = (calls[i](), start_ns, time.time_ns())
                except BaseException as err:  # noqa: BLE001 - user code; reported on one line below
                    errors[i] = err
                with lock:
                    finished[i] = True
                    lock.notify_all()

        for _ in range(min(self.spec.workers, n)):
            threading.Thread(target=worker, name=f"align-env-{method}", daemon=True).start()
        limit = self.spec.step_timeout
        with lock:
            while not all(finished):
                if errors and min(errors) <= min((i for i in range(n) if not finished[i]), default=n):
                    break  # an error that comes first in call order: report it without waiting for the rest
                now = time.monotonic()
                late = [i for i in range(n) if not finished[i] and (t := started[i]) is not None and now - t > limit]
                if late:
                    at = f", turn {turn}" if turn is not None else ""
                    raise AlignEnvError(
                        f"{self.where}: {labels[late[0]]}{at}: {method} did not return within "
                        f"step_timeout={limit:g} s (an environment that never answers; raise "
                        "model.environment.step_timeout if it is only slow)"
                    )
                lock.wait(timeout=min(0.05, limit))
        if errors:
            i = min(errors)
            err = errors[i]
            at = f", turn {turn}" if turn is not None else ""
            raise AlignEnvError(
                f"{self.where}: {labels[i]}{at}: {method} raised {type(err).__name__}: "
                f"{one_line(err)}{error_location(err, self.factory)}"
            ) from err
        return results

"""Multi-turn rollouts: episodes of a conversation between the policy and an environment (docs/environments.md).

:func:`play_episodes` plays ``group_size`` episodes for every prompt row of a batch, each on its own environment
instance (:class:`align.rollout.envs.chat.EnvironmentPool`):

1. ``reset(row)`` gives each episode its first messages, rendered with the chat template (generation prompt) into
   its prompt ids; when they are the row's own prompt conversation, the data module's ids are used as they are.
2. Each turn samples the next assistant message of every episode still running, in one batch, from the generation
   engine (:meth:`align.rollout.engine.GenerationEngine.decoding`, opened once for the whole rollout, over the
   left-padded contexts; episodes that finished have left the batch). The first turn may encode each group's prompt
   once (the native engine's ``shared_prefill``).
3. ``step(message)`` of every running episode (on worker threads, time-limited) gives the reward of the turn,
   whether the episode is over, and the reply. The reply is tokenized once, as the text the template adds after the
   assistant's stop token (:meth:`align.data.chat.ChatEncoder.reply_ids`), and appended to the episode's tokens.
   The sampled tokens are never re-tokenized: the policy is trained on the tokens it produced.

An episode ends when the environment says done, after ``max_turns`` turns, when its ``max_tokens`` budget (assistant
and environment tokens after the prompt) runs out (a turn is cut where it does, and a reply that does not fit is
not appended), or when a turn reaches ``sampling.max_new_tokens`` without a stop token. The environment still sees
and scores a cut turn, and the episode ends there as truncated whatever the environment answered; every end but
``done`` counts as truncated. No stop token is ever appended.

The result is a :class:`~align.rollout.types.Rollout` in the single-turn layout, so every algorithm trains on it as is:
``response_mask`` covers the policy's tokens only, so environment tokens carry no loss and no KL but stay in the
context (``context_mask``); ``old_logprobs`` are the sampling log-probs of the policy's tokens (0 elsewhere);
``token_rewards`` holds each turn's environment reward at the turn's last token (PPO places it there before GAE;
GRPO and RLOO sum it into the episode's outcome).
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from align.data.chat import ChatEncoder
from align.data.prompts import PromptBatch
from align.errors import AlignConfigError, AlignEnvError
from align.rollout.engine import GenerationEngine
from align.rollout.envs.chat import EnvironmentPool
from align.rollout.rewards import one_line
from align.rollout.sampling import left_pad
from align.rollout.types import Rollout

__all__ = ["play_episodes", "ENDS"]

ENDS = ("done", "max_turns", "max_tokens", "turn_length")
"""How an episode ends: the environment said done, or (truncated) the turn limit, the token budget, or a turn
reaching ``sampling.max_new_tokens`` without a stop token."""


@dataclass
class _Episode:
    slot: int
    label: str
    prompt_ids: list[int]
    messages: list[dict]
    ids: list[int] = field(default_factory=list)  # after the prompt: assistant and environment tokens
    assistant: list[bool] = field(default_factory=list)  # per token of ids: sampled by the policy
    logprobs: list[float] = field(default_factory=list)  # per token of ids: sampling log-prob (0: environment)
    rewards: list[tuple[int, float]] = field(default_factory=list)  # (index in ids of a turn's last token, reward)
    turns: int = 0
    end: str | None = None
    stopped: bool = False  # the last turn ended with a stop token
    text: str = ""  # the last assistant turn
    last_ids: list[int] = field(default_factory=list)
    info: dict[str, float] = field(default_factory=dict)
    calls: list[tuple] = field(default_factory=list)  # (turn, start_ns, end_ns, reward, done)
    first_messages: int = 0  # how many of ``messages`` reset gave


def _rows(batch: PromptBatch) -> list[dict]:
    """One dict per prompt: its columns, ``prompt`` and ``messages`` (copies: an environment may change them)."""
    messages = batch.messages or [[{"role": "user", "content": p}] for p in batch.prompts]
    return [
        {
            **{k: v[i] for k, v in batch.columns.items()},
            "prompt": batch.prompts[i],
            "messages": [dict(m) for m in messages[i]],
        }
        for i in range(len(batch))
    ]


def _turn_ids(ids: list[int], logprobs: list[float], limit: int, stop: set[int]) -> tuple[list[int], list[float], bool]:
    """A sampled row cut at its first stop token (kept) or at ``limit`` tokens: ``(ids, logprobs, stopped)``."""
    for i, token in enumerate(ids[:limit]):
        if token in stop:
            return ids[: i + 1], logprobs[: i + 1], True
    return ids[:limit], logprobs[:limit], False


@torch.no_grad()
def play_episodes(
    policy,
    engine: GenerationEngine,
    batch: PromptBatch,
    group_size: int,
    envs: EnvironmentPool,
    generator: torch.Generator | None = None,
    sync_stop: Callable[[bool], bool] | None = None,
) -> Rollout:
    """``group_size`` episodes per prompt of ``batch`` (see the module docstring); rows of a prompt are consecutive.

    ``sync_stop``: as for :func:`align.rollout.sampling.sample`. Under it every rank runs the same turns and decoding
    steps (a rank whose episodes have all ended samples a placeholder row until every rank's have)."""
    tok, spec, sampling = policy.tokenizer, envs.spec, engine.sampling
    encoder = ChatEncoder(tok)
    if not encoder.use_chat_template:
        raise AlignConfigError(f"{envs.where}: multi-turn episodes need a tokenizer with a chat_template")
    started = time.perf_counter()
    n = len(batch) * group_size
    rows = _rows(batch)
    labels = [f"episode {k} (prompt {k // group_size} of the batch, sample {k % group_size})" for k in range(n)]
    episodes = []
    for k, messages in enumerate(envs.reset([rows[k // group_size] for k in range(n)], labels)):
        i = k // group_size
        own = batch.messages is not None and messages == batch.messages[i]
        prompt = list(batch.prompt_ids[i]) if own else _render(encoder, envs, labels[k], messages)
        episodes.append(_Episode(k, labels[k], prompt, messages, first_messages=len(messages)))
    device = next(policy.parameters()).device
    stop, pad = set(engine.stop_ids(tok)), tok.pad_token_id
    width = max(len(e.prompt_ids) for e in episodes)
    sampling_seconds = env_seconds = 0.0
    engine.decoding_metrics = {}
    with engine.decoding(policy, width + spec.max_tokens + sampling.max_new_tokens) as decode:
        for turn in range(1, spec.max_turns + 1):
            active = [e for e in episodes if e.end is None]
            if sync_stop(not active) if sync_stop is not None else not active:
                break
            contexts = [e.prompt_ids + e.ids for e in active] or [[pad]]  # a placeholder row keeps a rank in step
            limits = [spec.max_tokens - len(e.ids) for e in active]
            max_new = sampling.max_new_tokens if sync_stop is not None else min(sampling.max_new_tokens, max(limits))
            ids, mask = left_pad(contexts, pad)
            shared = (
                group_size
                if (
                    turn == 1
                    and len(active) == n
                    and all(contexts[k] == contexts[k - k % group_size] for k in range(n))
                )
                else 1
            )
            clock = time.perf_counter()
            out = decode(
                ids.to(device),
                mask.to(device),
                max_new_tokens=max_new,
                min_new_tokens=min(sampling.min_new_tokens, max_new),
                generator=generator,
                sync_stop=sync_stop,
                shared_prefix=shared,
            )
            sampling_seconds += time.perf_counter() - clock
            if not active:
                continue
            messages = []
            for e, row_ids, row_logprobs, limit in zip(
                active, out.response_ids.tolist(), out.logprobs.tolist(), limits
            ):
                turn_ids, turn_logprobs, e.stopped = _turn_ids(row_ids, row_logprobs, limit, stop)
                e.text = tok.decode(turn_ids, skip_special_tokens=True)
                messages.append(_assistant_message(tok, e.prompt_ids + e.ids, turn_ids, e.text))
                e.ids += turn_ids
                e.assistant += [True] * len(turn_ids)
                e.logprobs += turn_logprobs
                e.turns, e.last_ids = turn, turn_ids
            clock = time.perf_counter()
            steps, records = envs.step([e.slot for e in active], messages, [e.label for e in active], turn)
            env_seconds += time.perf_counter() - clock
            for e, message, step, record in zip(active, messages, steps, records):
                e.messages.append(message)
                e.rewards.append((len(e.ids) - 1, step.reward))
                e.calls.append((turn, record.start_ns, record.end_ns, step.reward, step.done))
                assert step.info is not None  # the pool's steps always carry a dict (EnvironmentPool.step)
                for key, value in step.info.items():
                    if isinstance(value, numbers.Real) and not isinstance(value, bool):
                        e.info[key] = e.info.get(key, 0.0) + float(value)
                e.end = _end(e, step.done, turn, spec.max_turns, spec.max_tokens)
                if e.end is not None:
                    continue
                reply = _reply(encoder, envs, e, step.messages, turn)
                if len(e.ids) + len(reply) >= spec.max_tokens:  # no room for the policy's next token
                    e.end = "max_tokens"
                    continue
                e.ids += reply
                e.assistant += [False] * len(reply)
                e.logprobs += [0.0] * len(reply)
                e.messages += step.messages
    rollout = _rollout(
        episodes, batch, group_size, pad, device, time.perf_counter() - started, sampling_seconds, env_seconds
    )
    rollout.metrics.update(engine.decoding_metrics)  # what the engine did besides decoding (a weight sync)
    return rollout


def _assistant_message(tok, context_ids: list[int], turn_ids: list[int], text: str) -> dict:
    """The policy's turn as a message: parsed by the tokenizer's response template when it has one (its
    ``tool_calls`` and ``content``), else the decoded text as ``content``."""
    if getattr(tok, "response_template", None) is not None:
        try:
            parsed = tok.parse_response(turn_ids, prefix=context_ids)
        except Exception:  # noqa: BLE001 - an unparsable turn is still a turn: its text is the message
            parsed = None
        if isinstance(parsed, dict):
            return {**parsed, "role": "assistant", "content": parsed.get("content") or ""}
    return {"role": "assistant", "content": text}


def _render(encoder: ChatEncoder, envs: EnvironmentPool, label: str, messages: list[dict]) -> list[int]:
    try:
        return encoder.prompt_ids(messages)
    except AlignConfigError as err:
        raise AlignConfigError(f"{envs.where}: {label}: {err}") from err
    except Exception as err:  # noqa: BLE001 - the template rejects what reset returned
        raise AlignEnvError(
            f"{envs.where}: {label}: the chat template cannot render reset's messages: "
            f"{type(err).__name__}: {one_line(err)}"
        ) from err


def _reply(encoder: ChatEncoder, envs: EnvironmentPool, e: _Episode, replies: list[dict], turn: int) -> list[int]:
    try:
        return encoder.reply_ids(e.messages, replies)
    except AlignConfigError as err:  # a template that cannot continue a sampled turn
        raise AlignConfigError(f"{envs.where}: {e.label}, turn {turn}: {err}") from err
    except Exception as err:  # noqa: BLE001 - e.g. a role the template does not know
        roles = sorted({m["role"] for m in replies})
        raise AlignEnvError(
            f"{envs.where}: {e.label}, turn {turn}: the chat template cannot render the reply (roles "
            f"{roles}): {type(err).__name__}: {one_line(err)}"
        ) from err


def _end(e: _Episode, done: bool, turn: int, max_turns: int, max_tokens: int) -> str | None:
    """Why the episode ends after this turn (:data:`ENDS`), or None when it goes on. A turn cut without its stop
    token ends the episode as truncated even when the environment said done (it cannot tell a cut turn)."""
    if not e.stopped:
        return "max_tokens" if len(e.ids) >= max_tokens else "turn_length"
    if done:
        return "done"
    return "max_turns" if turn >= max_turns else None


def _rollout(
    episodes: list[_Episode],
    batch: PromptBatch,
    group_size: int,
    pad: int,
    device,
    seconds: float,
    sampling_seconds: float,
    env_seconds: float,
) -> Rollout:
    n = len(episodes)
    prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], pad)
    width = max(len(e.ids) for e in episodes)
    response_ids = torch.full((n, width), pad, dtype=torch.long)
    response_mask = torch.zeros((n, width), dtype=torch.bool)
    context_mask = torch.zeros((n, width), dtype=torch.long)
    old_logprobs = torch.zeros((n, width), dtype=torch.float32)
    token_rewards = torch.zeros((n, width), dtype=torch.float32)
    for row, e in enumerate(episodes):
        length = len(e.ids)
        response_ids[row, :length] = torch.tensor(e.ids, dtype=torch.long)
        response_mask[row, :length] = torch.tensor(e.assistant, dtype=torch.bool)
        context_mask[row, :length] = 1
        old_logprobs[row, :length] = torch.tensor(e.logprobs, dtype=torch.float32)
        for index, reward in e.rewards:
            token_rewards[row, index] += reward
    truncated = torch.tensor([e.end != "done" for e in episodes])
    records = [
        {
            "messages": e.messages,
            "first_messages": e.first_messages,
            "turns": e.turns,
            "end": e.end,
            "env_reward": sum(r for _, r in e.rewards),
            "info": e.info,
            "completion_ids": e.last_ids,
            "calls": e.calls,
        }
        for e in episodes
    ]
    assistant = float(response_mask.sum())
    metrics = {
        "rollout/completion_tokens": assistant,
        "rollout/tokens_per_s": assistant / max(sampling_seconds, 1e-9),
        "rollout/response_length": assistant / n,
        "rollout/environment_tokens": float(context_mask.sum() - assistant) / n,
        "rollout/truncated_frac": float(truncated.float().mean()),
        "rollout/turns": sum(e.turns for e in episodes) / n,
        "time/env_s": env_seconds,
    }
    for key in sorted({k for e in episodes for k in e.info}):
        name = f"rollout/{key}" if f"rollout/{key}" not in metrics else f"rollout/info/{key}"  # never a built-in's
        metrics[name] = sum(e.info.get(key, 0.0) for e in episodes) / n
    prompt_index = torch.arange(len(batch)).repeat_interleave(group_size)

    def to(t):
        return t.to(device)

    return Rollout(
        to(prompt_ids),
        to(prompt_mask),
        to(response_ids),
        to(response_mask),
        to(old_logprobs),
        to(truncated),
        [e.text for e in episodes],
        to(prompt_index),
        group_size,
        seconds,
        metrics,
        context_mask=to(context_mask),
        token_rewards=to(token_rewards),
        episodes=records,
    )

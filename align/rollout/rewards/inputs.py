"""What every reward receives: ``prompts`` and ``completions`` first (:data:`BASE_INPUTS`), then the data's columns
and the rollout's own inputs (:data:`~align.data.prompts.REWARD_INPUTS`), built for a rollout by
:func:`reward_inputs`.
"""

from __future__ import annotations

from typing import Any

BASE_INPUTS = ("prompts", "completions")
"""Keyword arguments every reward receives first; the rollout's own inputs (``REWARD_INPUTS``) and the data's
columns follow."""


def reward_inputs(batch, rollout) -> dict[str, Any]:
    """The keyword arguments of every reward for ``rollout``, sampled from the prompts of ``batch`` (a
    :class:`~align.data.prompts.PromptBatch`): ``prompts``, ``completions``, the data's columns and the rollout's
    inputs (:data:`~align.data.prompts.REWARD_INPUTS`), one value per completion (a prompt's ``group_size``
    completions are consecutive).

    For a multi-turn rollout (``rollout.episodes``) a completion is the episode's last assistant turn
    (``completions``, ``completion_ids``), ``prompt_messages`` the episode's first messages (what the environment's
    ``reset`` gave), ``conversation`` every message of the episode, and ``completion_truncated`` whether the
    episode was cut off before the environment said done."""
    prompts, columns = batch.repeat(rollout.group_size)
    truncated = [bool(t) for t in rollout.truncated.tolist()]
    if rollout.episodes is not None:
        conversations = [e["messages"] for e in rollout.episodes]
        first = [e["messages"][: e["first_messages"]] for e in rollout.episodes]
        return {
            "prompts": prompts,
            "completions": rollout.texts,
            **columns,
            "prompt_messages": first,
            "completion_ids": [list(e["completion_ids"]) for e in rollout.episodes],
            "completion_truncated": truncated,
            "conversation": conversations,
        }
    lengths = rollout.response_lengths.tolist()
    prompt_messages = batch.repeat_messages(rollout.group_size)
    return {
        "prompts": prompts,
        "completions": rollout.texts,
        **columns,
        "prompt_messages": prompt_messages,
        "completion_ids": [ids[:n] for ids, n in zip(rollout.response_ids.tolist(), lengths)],
        "completion_truncated": truncated,
        "conversation": [m + [{"role": "assistant", "content": t}] for m, t in zip(prompt_messages, rollout.texts)],
    }

"""Environments, beside the language-model rollout engine (:mod:`align.rollout`).

* Language-model policies: :mod:`align.envs.chat` (the ``reset``/``step`` interface of a conversation, played over
  several turns by :mod:`align.episodes`), :mod:`align.envs.tools` (tool calling: a calculator and a sandboxed
  ``python``) and :mod:`align.envs.tasks` (the bundled multi-turn tasks). They need nothing beyond align's own
  dependencies.
* Classic RL: Gymnasium's vector environments made from an id or an import path (:mod:`align.envs.make`), and the
  one place that steps them with a policy and records what happened (:mod:`align.envs.runner`). They need the
  ``gym`` extra, so their names are imported on first use: ``from align.envs import EnvRunner`` works as before,
  and importing :mod:`align.envs.chat` never imports Gymnasium.
"""

from __future__ import annotations

import importlib
from typing import Any

_GYM_NAMES = {"EnvSpec": "make", "make_vector_env": "make", "require_discrete_actions": "make", "space_text": "make",
              "EnvRunner": "runner", "Episode": "runner", "Steps": "runner"}

__all__ = sorted(_GYM_NAMES)


def __getattr__(name: str) -> Any:
    module = _GYM_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'align.envs' has no attribute {name!r}")
    return getattr(importlib.import_module(f"align.envs.{module}"), name)

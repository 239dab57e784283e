"""Environments for classic RL: Gymnasium's vector environments made from an id or an import path
(:mod:`align.envs.make`), and the one place that steps them with a policy and records what happened
(:mod:`align.envs.runner`), beside the language-model rollout engine (:mod:`align.rollout`)."""

from align.envs.make import EnvSpec, make_vector_env, require_discrete_actions, space_text
from align.envs.runner import EnvRunner, Episode, Steps

__all__ = ["EnvRunner", "EnvSpec", "Episode", "Steps", "make_vector_env", "require_discrete_actions", "space_text"]

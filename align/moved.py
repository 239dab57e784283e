"""Modules that moved when the package was laid out in layer folders: importing an old path fails on one line that
names the new one (docs/architecture.md lists the layers). The public paths written in configs keep working:
``align.rewards.*`` and ``align.strategies.*`` are aliases of their new homes."""

from __future__ import annotations

import importlib.abc
import sys

MOVED = {
    "align.logprobs": "align.core.logprobs", "align.kl": "align.core.kl", "align.advantages": "align.core.advantages",
    "align.losses": "align.core.losses", "align.trust_region": "align.core.trust_region",
    "align.stats": "align.core.stats", "align.packing": "align.core.packing",
    "align.rollout_filter": "align.rollout.filter", "align.episodes": "align.rollout.episodes",
    "align.generation": "align.rollout.generation",
    "align.envs": "align.rollout.envs", "align.envs.chat": "align.rollout.envs.chat",
    "align.envs.tools": "align.rollout.envs.tools", "align.envs.tasks": "align.rollout.envs.tasks",
    "align.envs.make": "align.gym.make", "align.envs.runner": "align.gym.runner", "align.envs.replay": "align.gym.replay",
    "align.models.mlp": "align.gym.networks", "align.modules.classic": "align.gym",
    "align.modules.classic.base": "align.gym.base", "align.modules.classic.dqn": "align.gym.dqn",
    "align.modules.classic.onpolicy": "align.gym.onpolicy",
    "align.checkpointing": "align.trainer.checkpointing", "align.guards": "align.trainer.guards",
    "align.optim": "align.trainer.optim", "align.host_memory": "align.trainer.host_memory",
    "align.observability.progress": "align.trainer.progress", "align.observability.plots": "align.cli.plots",
    "align.runs": "align.cli.runs", "align.quiet": "align.cli.quiet", "align.config_errors": "align.cli.config_errors",
    "align.generation_cli": "align.cli.generation",
    "align.strategies.collectives": "align.trainer.strategies.collectives",
    "align.strategies.deepspeed": "align.trainer.strategies.deepspeed",
    "align.strategies.fsdp": "align.trainer.strategies.fsdp", "align.strategies.gather": "align.trainer.strategies.gather",
}
"""``{old module: new module}``."""


RENAMED_SETTINGS = {
    "model.clip.level": "model.policy_loss.name (clip.level: sequence is policy_loss.name: gspo)",
    "model.dynamic_sampling": "model.source (dynamic_sampling.enabled: true is source: align.rollout.source.FilteredSource, "
                              "with its max_batches and reward)",
    # The classic-RL modules (align.gym) took the language-model modules' option groups (docs/classic_rl.md).
    "model.ent_coef": "model.entropy_coef",
    "model.vf_coef": "model.value.coef",
    "model.clip_range_vf": "model.value.clip",
    "model.clip_range": "model.clip.low",
    "model.clip_schedule": "model.clip.schedule",
    "model.gae_lambda": "model.gae.lam",
    "model.normalize_advantages": "model.gae.whiten_advantages",
    "model.gamma": "model.gae.gamma (PPO, A2C and REINFORCE; DQN and Q-learning keep model.gamma)",
    "model.n_epochs": "model.updates.epochs",
    "model.batch_size": "model.updates.minibatch_size (transitions per optimizer step)",
    "model.max_grad_norm": "model.updates.max_grad_norm",
    "model.target_kl": "model.updates.target_kl",
    "model.gradient_steps": "model.updates.gradient_steps",
    "model.n_steps": "model.steps_per_iteration",
    "model.train_freq": "model.steps_per_iteration",
    "model.policy.value_head": "model.policy.critic.kind (value_head: shared is critic: {kind: shared}, value_head: "
                               "separate is critic: {kind: separate})",
    "model.policy.critic_model": "model.policy.critic.model (critic: {kind: separate, model: ...})",
    "model.policy.critic_head_from_reward_model": "model.policy.critic.head_from_reward_model",
}
"""``{old setting: what to write instead}``: settings of a module or model that were renamed or regrouped. A config
that still uses one fails on one line naming the new setting (:mod:`align.cli.config_errors`)."""


def renamed_message(key: str) -> str | None:
    """The one-line notice for an old setting (``model.clip.level``, or a key inside an old group), else None."""
    for old in sorted(RENAMED_SETTINGS, key=len, reverse=True):
        if key == old or key.startswith(old + "."):
            return f"{key}: this setting was renamed; write {RENAMED_SETTINGS[old]}"
    return None


def moved_message(name: str) -> str | None:
    """The one-line notice for an old module path (or a name inside one), None for a path that did not move."""
    for old in sorted(MOVED, key=len, reverse=True):
        if name == old or name.startswith(old + "."):
            new = MOVED[old] + name[len(old):]
            return f"{name} moved to {new}: write {new} (align's modules live in layer folders, see docs/architecture.md)"
    return None


class _MovedModules(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            raise ModuleNotFoundError(moved_message(fullname), name=fullname)
        return None


def install() -> None:
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())

"""Export: a merged Hugging Face model and tokenizer from a checkpoint, or at the end of a run.

A policy checkpoint exports as a causal LM (``AutoModelForCausalLM`` loads it); a reward-model checkpoint (one
written by :class:`~align.modules.reward.RewardModule`) as a sequence-classification model with its trained head
(:func:`align.models.reward_export.save_reward_model`).
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import lightning as L

from align.models.checkpoints import is_reward_checkpoint, load_checkpoint, policy_from_checkpoint
from align.models.policy import PolicyModel
from align.models.reward_export import save_reward_model

__all__ = ["ExportCallback", "export_checkpoint", "is_reward_checkpoint", "load_checkpoint", "policy_from_checkpoint"]


def export_checkpoint(ckpt_path: str | Path, output_dir: str | Path, dtype: str | None = None) -> Path:
    """Write ``output_dir`` from an align checkpoint: a causal LM, or a sequence classifier for a reward model."""
    checkpoint = load_checkpoint(ckpt_path)
    if is_reward_checkpoint(checkpoint):
        policy = policy_from_checkpoint(ckpt_path, checkpoint=checkpoint, reward_head=True)
        return save_reward_model(policy, output_dir, checkpoint["align"]["reward"].get("encoding"), dtype=dtype)
    return policy_from_checkpoint(ckpt_path, checkpoint=checkpoint).save_pretrained(output_dir, dtype=dtype)


class ExportCallback(L.Callback):
    """Write a merged Hugging Face model and tokenizer to ``output_dir`` when ``fit`` ends (global rank 0): a causal
    LM, or for a reward-model run (a module with ``encoding_spec``) the reward model's export format."""

    def __init__(self, output_dir: str, dtype: str | None = None):
        self.output_dir = output_dir
        self.dtype = dtype

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        policy = cast(PolicyModel, pl_module.policy)  # every align module keeps its PolicyModel as ``policy``
        critic = policy.critic
        encoding_spec = getattr(pl_module, "encoding_spec", None)  # the reward-model module's
        if encoding_spec is not None and critic is not None and not critic.separate:
            save_reward_model(policy, self.output_dir, encoding_spec(), dtype=self.dtype)
        else:
            policy.save_pretrained(self.output_dir, dtype=self.dtype)

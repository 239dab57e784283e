"""Export: a merged Hugging Face model and tokenizer from a checkpoint, or at the end of a run.

A policy checkpoint exports as a causal LM (``AutoModelForCausalLM`` loads it); a reward-model checkpoint (one
written by :class:`~align.modules.reward.RewardModule`) as a sequence-classification model with its trained head
(:func:`align.models.reward.save_reward_model`).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from align.errors import AlignConfigError
from align.models.loading import DType, LoraSettings
from align.models.policy import PolicyModel


def load_checkpoint(path: str | Path) -> dict:
    """Load a checkpoint's tensors and plain metadata only (``weights_only``: no code runs on load)."""
    path = Path(path)
    if not path.exists():
        raise AlignConfigError(f"ckpt_path: '{path}' does not exist")
    return torch.load(path, map_location="cpu", weights_only=True)


def is_reward_checkpoint(checkpoint: dict) -> bool:
    """Whether a loaded checkpoint was written by the reward-model module (its metadata has a ``reward`` entry)."""
    return "reward" in (checkpoint.get("align") or {})


def policy_from_checkpoint(path: str | Path, checkpoint: dict | None = None, reward_head: bool = False,
                           dtype: DType | None = None) -> PolicyModel:
    """Rebuild the run's ``PolicyModel`` from the spec stored in the checkpoint and load its weights.

    ``reward_head``: keep the scalar head (``value_head="shared"``) and load it too. ``checkpoint``: the already
    loaded ``path``. ``dtype``: override the run's weight dtype.
    """
    checkpoint = checkpoint if checkpoint is not None else load_checkpoint(path)
    meta = checkpoint.get("align")
    if not meta or "policy" not in meta:
        raise AlignConfigError(f"ckpt_path: '{path}' was not written by an align module (no 'align' metadata)")
    spec = dict(meta["policy"])
    if spec.get("lora"):
        spec["lora"] = LoraSettings(**spec["lora"])
    if dtype is not None:
        spec["dtype"] = dtype
    # The reference and critic are not exported; skip loading them.
    spec["reference_model"] = None
    spec["critic_model"] = None
    spec["value_head"] = "shared" if reward_head else None
    policy = PolicyModel(**spec)
    kept = ("model.", "value_head.") if reward_head else ("model.",)
    prefix = "policy."
    state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    state = {k: v for k, v in state.items() if k.startswith(kept)}
    missing, unexpected = policy.load_state_dict(state, strict=False)
    missing = [k for k in missing if k.startswith(kept)]
    if missing or unexpected:
        raise AlignConfigError(f"ckpt_path: '{path}' does not match its policy spec (missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]})")
    return policy


def export_checkpoint(ckpt_path: str | Path, output_dir: str | Path, dtype: str | None = None) -> Path:
    """Write ``output_dir`` from an align checkpoint: a causal LM, or a sequence classifier for a reward model."""
    checkpoint = load_checkpoint(ckpt_path)
    if is_reward_checkpoint(checkpoint):
        from align.models.reward import save_reward_model

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
        if hasattr(pl_module, "encoding_spec") and pl_module.policy.value_head is not None:
            from align.models.reward import save_reward_model

            save_reward_model(pl_module.policy, self.output_dir, pl_module.encoding_spec(), dtype=self.dtype)
        else:
            pl_module.policy.save_pretrained(self.output_dir, dtype=self.dtype)

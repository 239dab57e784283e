"""Reading align's training checkpoints (``.ckpt``): their metadata, and the policy rebuilt from the spec stored in
them (``checkpoint["align"]["policy"]``, :attr:`PolicyModel.spec`) with its weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from align.errors import AlignConfigError
from align.models.critic import CriticSettings, critic_settings
from align.models.loading import DType, LoraSettings
from align.models.policy import PolicyModel


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint's tensors and plain metadata only (``weights_only``: no code runs on load)."""
    path = Path(path)
    if not path.exists():
        raise AlignConfigError(f"ckpt_path: '{path}' does not exist")
    checkpoint: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return checkpoint


def is_reward_checkpoint(checkpoint: dict[str, Any]) -> bool:
    """Whether a loaded checkpoint was written by the reward-model module (its metadata has a ``reward`` entry)."""
    return "reward" in (checkpoint.get("align") or {})


def policy_settings(spec: dict[str, Any]) -> dict[str, Any]:
    """:class:`PolicyModel` arguments from a saved :attr:`PolicyModel.spec`."""
    settings = dict(spec)
    if settings.get("lora"):
        settings["lora"] = LoraSettings(**settings["lora"])
    settings["critic"] = critic_settings(settings.get("critic"))
    return settings


def policy_from_checkpoint(
    path: str | Path, checkpoint: dict[str, Any] | None = None, reward_head: bool = False, dtype: DType | None = None
) -> PolicyModel:
    """Rebuild the run's ``PolicyModel`` from the spec stored in the checkpoint and load its weights.

    ``reward_head``: keep the scalar head (a shared critic) and load it too. ``checkpoint``: the already loaded
    ``path``. ``dtype``: override the run's weight dtype.
    """
    checkpoint = checkpoint if checkpoint is not None else load_checkpoint(path)
    meta = checkpoint.get("align")
    if not meta or "policy" not in meta:
        raise AlignConfigError(f"ckpt_path: '{path}' was not written by an align module (no 'align' metadata)")
    spec = policy_settings(meta["policy"])
    if dtype is not None:
        spec["dtype"] = dtype
    # The reference and a separate critic are not exported; skip loading them.
    spec["reference_model"] = None
    spec["critic"] = CriticSettings(kind="shared") if reward_head else None
    policy = PolicyModel(**spec)
    kept = ("model.", "critic.head.") if reward_head else ("model.",)
    prefix = "policy."
    state = {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    state = {k: v for k, v in state.items() if k.startswith(kept)}
    missing, unexpected = policy.load_state_dict(state, strict=False)
    missing = [k for k in missing if k.startswith(kept)]
    if missing or unexpected:
        raise AlignConfigError(
            f"ckpt_path: '{path}' does not match its policy spec (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    return policy

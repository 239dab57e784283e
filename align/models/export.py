"""Export: a merged Hugging Face model and tokenizer from a checkpoint, or at the end of a run."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from align.errors import AlignConfigError
from align.models.loading import LoraSettings
from align.models.policy import PolicyModel


def load_checkpoint(path: str | Path) -> dict:
    """Load a checkpoint's tensors and plain metadata only (``weights_only``: no code runs on load)."""
    path = Path(path)
    if not path.exists():
        raise AlignConfigError(f"ckpt_path: '{path}' does not exist")
    return torch.load(path, map_location="cpu", weights_only=True)


def policy_from_checkpoint(path: str | Path) -> PolicyModel:
    """Rebuild the run's ``PolicyModel`` from the spec stored in the checkpoint and load its weights."""
    checkpoint = load_checkpoint(path)
    meta = checkpoint.get("align")
    if not meta or "policy" not in meta:
        raise AlignConfigError(f"ckpt_path: '{path}' was not written by an align module (no 'align' metadata)")
    spec = dict(meta["policy"])
    if spec.get("lora"):
        spec["lora"] = LoraSettings(**spec["lora"])
    # The reference and critic are not exported; skip loading them.
    spec["reference_model"] = None
    spec["value_head"] = None
    policy = PolicyModel(**spec)
    prefix = "policy."
    state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    state = {k: v for k, v in state.items() if k.startswith("model.")}
    missing, unexpected = policy.load_state_dict(state, strict=False)
    missing = [k for k in missing if k.startswith("model.")]
    if missing or unexpected:
        raise AlignConfigError(f"ckpt_path: '{path}' does not match its policy spec (missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]})")
    return policy


def export_checkpoint(ckpt_path: str | Path, output_dir: str | Path, dtype: str | None = None) -> Path:
    return policy_from_checkpoint(ckpt_path).save_pretrained(output_dir, dtype=dtype)


class ExportCallback(L.Callback):
    """Write a merged Hugging Face model and tokenizer to ``output_dir`` when ``fit`` ends (global rank 0)."""

    def __init__(self, output_dir: str, dtype: str | None = None):
        self.output_dir = output_dir
        self.dtype = dtype

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            pl_module.policy.save_pretrained(self.output_dir, dtype=self.dtype)

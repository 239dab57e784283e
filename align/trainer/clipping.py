"""Gradient clipping under every precision and optimizer (:func:`clip_gradients`).

Lightning's mixed-precision plugin refuses to clip for an optimizer that unscales gradients inside its own step
(``torch.optim.AdamW(fused=True)``, any optimizer with ``_step_supports_amp_scaling``), because under ``16-mixed``
the gradients it would clip are still multiplied by the loss scale. ``bf16-mixed`` has no loss scale: the
gradients are the true ones whatever the optimizer, so they are clipped here as the plain precision plugin clips
them. Under ``16-mixed`` (a loss scale) Lightning's own clipping stays in charge, and the fused case fails on one
line naming the settings instead.
"""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from align.errors import AlignConfigError

__all__ = ["clip_gradients", "clips_itself"]


def clips_itself(plugin: Precision) -> bool:
    """Whether align clips the gradients instead of ``plugin``: mixed precision without a loss scale (bf16)."""
    return isinstance(plugin, MixedPrecision) and plugin.scaler is None


def clip_gradients(
    module,
    optimizer: torch.optim.Optimizer,
    value: float | None,
    algorithm: str | GradClipAlgorithmType | None = "norm",
) -> None:
    """Clip the gradients of ``optimizer``'s parameters to ``value`` (by ``"norm"`` or ``"value"``; ``None`` or
    ``<= 0``: no clipping) under ``module``'s trainer, whatever its precision and whatever the optimizer."""
    plugin = module.trainer.precision_plugin
    algorithm = GradClipAlgorithmType((algorithm or "norm").lower())
    if not value or value <= 0:
        return
    if clips_itself(plugin):
        Precision.clip_gradients(plugin, optimizer, float(value), algorithm)
        return
    if isinstance(plugin, MixedPrecision) and getattr(optimizer, "_step_supports_amp_scaling", False):
        raise AlignConfigError(
            f"trainer.precision {plugin.precision}: {type(optimizer).__name__} unscales the gradients inside its "
            "step (a fused optimizer), so they cannot be clipped before it; use trainer.precision bf16-mixed, "
            "model.optimizer.init_args.fused false, or no gradient clipping"
        )
    module.clip_gradients(optimizer, gradient_clip_val=value, gradient_clip_algorithm=algorithm.value)

"""The reference model of a :class:`~align.models.policy.PolicyModel`: what the KL penalty, DPO's implicit reward
and the reference log-probs are measured against.

It is, in order of preference: the policy with its LoRA adapter switched off (no second copy; :class:`AdapterSwitch`),
a separately loaded ``reference_model``, or a frozen copy of the initial policy (:func:`build_reference`).
:func:`reference_context` gives the model to run for a reference pass.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from align.errors import AlignConfigError
from align.models.loading import LoadKwargs, LoraSettings, load_causal_lm

if TYPE_CHECKING:
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper


class ReferencePolicy(Protocol):
    """What the reference reads of a :class:`~align.models.policy.PolicyModel` (which imports this module)."""

    @property
    def spec(self) -> dict[str, Any]: ...

    @property
    def lora(self) -> LoraSettings | None: ...

    @property
    def load_kwargs(self) -> LoadKwargs: ...

    @property
    def model(self) -> nn.Module: ...

    @property
    def ref_model(self) -> nn.Module | None: ...

    @property
    def has_adapter(self) -> bool: ...

    @property
    def adapter_switch(self) -> AdapterSwitch: ...


def adapter_switch_types() -> tuple[type[BaseTunerLayer], type[AuxiliaryTrainingWrapper]]:
    """peft module types that ``enable_adapters(False)`` returns to the base model's computation."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    wrapper: type[AuxiliaryTrainingWrapper]
    try:  # peft >= 0.15: the base class of ModulesToSaveWrapper and TrainableTokensWrapper
        from peft.utils.other import AuxiliaryTrainingWrapper

        wrapper = AuxiliaryTrainingWrapper
    except ImportError:  # pragma: no cover - older peft
        from peft.utils.other import ModulesToSaveWrapper

        wrapper = ModulesToSaveWrapper
    return BaseTunerLayer, wrapper


class AdapterSwitch:
    """peft's ``disable_adapter`` without its per-call status walk over every module.

    As in peft, both the LoRA layers and the auxiliary wrappers (``modules_to_save``, trainable tokens) are
    switched off, so the model computes with its base weights only. peft's context inspects the whole model
    (``get_model_status``) on each entry, which costs tens of milliseconds per reference forward on small
    models; the switchable modules are found once here instead.

    Without gradients (every reference pass) only each module's switch is flipped: that is all its forward
    reads. ``enable_adapters`` also sets ``requires_grad`` on every adapter tensor, off and then on again, a
    walk that cost a few milliseconds per pass on the tiny model and changes nothing a no-grad pass computes.
    """

    def __init__(self, model: nn.Module) -> None:
        kinds = adapter_switch_types()
        self.layers: list[BaseTunerLayer | AuxiliaryTrainingWrapper] = [
            m for m in model.modules() if isinstance(m, kinds)
        ]
        self.flags_only = all(hasattr(layer, "_disable_adapters") for layer in self.layers)

    @contextmanager
    def off(self) -> Iterator[None]:
        layers = self.layers
        was_off = [layer.disable_adapters for layer in layers]
        switch_only = not torch.is_grad_enabled() and self.flags_only
        try:
            for layer in layers:
                if switch_only:
                    layer._disable_adapters = True
                else:
                    layer.enable_adapters(False)
            yield
        finally:
            for layer, off in zip(layers, was_off):
                if switch_only:
                    layer._disable_adapters = off
                elif not off:
                    layer.enable_adapters(True)


def build_reference(policy: ReferencePolicy) -> nn.Module | None:
    """The reference model to keep beside ``policy``, or None when the adapter-disabled policy is the reference.

    With LoRA nothing is copied: every LoRA layer and every module trained in full beside it
    (``lora.modules_to_save``) is switched to the base weights. Trained biases (``lora.bias``) change the base layers
    themselves, so they need a separate ``reference_model``. Otherwise ``reference_model`` is loaded, or a frozen
    copy of the current (initial) weights is kept.
    """
    reference_model = policy.spec["reference_model"]
    if policy.has_adapter and not reference_model:
        assert policy.lora is not None  # has_adapter
        if policy.lora.bias != "none":
            raise AlignConfigError(
                f"model.policy.lora.bias: expected 'none' without model.policy.reference_model, got "
                f"{policy.lora.bias!r}, which trains the base model's biases, so the adapter-disabled model is no "
                "longer the initial one and cannot be the reference; use bias: none, or set "
                "model.policy.reference_model to the base model"
            )
        return None
    ref: nn.Module
    if reference_model:
        ref = load_causal_lm(reference_model, **policy.load_kwargs)
    else:
        ref = copy.deepcopy(policy.model)
    return ref.requires_grad_(False).eval()


@contextmanager
def reference_context(policy: ReferencePolicy) -> Iterator[nn.Module]:
    """The model a reference pass runs: the kept reference, or the policy's model with its adapter off."""
    if policy.ref_model is not None:
        yield policy.ref_model
    elif policy.has_adapter:
        with policy.adapter_switch.off():
            yield policy.model
    else:
        raise RuntimeError("no reference model: call PolicyModel.setup_reference() first")

"""A LoRA linear layer computed as one autograd function (``LoraSettings.fused``, on by default).

peft's ``lora.Linear`` computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` as five modules and operations,
each a node of the autograd graph and a Python call; autograd keeps ``dropout(x)`` and ``lora_A``'s output for the
backward. :class:`FusedLoraLinear` computes the same sum with three matrix products in one function
(:class:`LoraLinearFunction`), keeps only ``dropout(x)`` (the ``(N, r)`` product is recomputed in the backward,
where it costs ``r / out`` of the base layer's product) and writes the backward's five products by hand. On a
model whose layers are small the per-call cost is a large part of a step (a tiny model's LoRA DPO step), and on
any model the step saves the ``(N, out)`` temporaries of the scaling and the sum.

The function applies where its arithmetic is peft's own: one active adapter of plain LoRA (no DoRA or other
variant, no bias on ``lora_B``) over an ``nn.Linear`` whose weight is frozen, not transposed (``fan_in_fan_out``),
not merged, and of the input's dtype, outside autocast, with no per-call adapter arguments and no DeepSpeed
ZeRO-3 or DTensor parameters (whose weights are gathered by hooks on the submodules this does not call). Anywhere
else, and with ``fused: false``, the layer is peft's (its ``forward`` is called unchanged). Pinned to peft's forward
(values, every gradient, the dropout mask and second derivatives) by ``tests/models/test_lora.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

# What the fused function takes from a layer: ``(W, b, A, B, scaling, dropout or None)``.
_FusedOperands = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, float, nn.Dropout | None]


class LoraLinearFunction(torch.autograd.Function):
    """``y = x W^T + b + scaling * (d A^T) B^T`` with ``d`` the adapter's (dropped-out) input; ``d is x`` without
    dropout. ``W`` and ``b`` are frozen. Shapes: ``x, d (..., in)``, ``W (out, in)``, ``A (r, in)``, ``B (out, r)``."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,  # (..., in)
        d: torch.Tensor,  # (..., in)
        weight: torch.Tensor,  # (out, in)
        bias: torch.Tensor | None,  # (out,)
        lora_a: torch.Tensor,  # (r, in)
        lora_b: torch.Tensor,  # (out, r)
        scaling: float,
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        d2 = x2 if d is x else d.reshape(-1, d.shape[-1])
        y = torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())  # (N, out)
        y.addmm_(torch.mm(d2, lora_a.t()), lora_b.t(), alpha=scaling)
        ctx.same_input = d is x
        ctx.scaling = scaling
        ctx.save_for_backward(d, weight, lora_a, lora_b)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Plain differentiable operations on the saved inputs, so a second derivative (create_graph) is exact.
        d, weight, lora_a, lora_b = ctx.saved_tensors
        s = ctx.scaling
        g = grad.reshape(-1, grad.shape[-1])  # (N, out)
        d2 = d.reshape(-1, d.shape[-1])  # (N, in)
        need_x, need_d, _, _, need_a, need_b, _ = ctx.needs_input_grad
        gb = torch.mm(g, lora_b) if (need_x or need_d or need_a) else None  # (N, r)
        grad_x = grad_d = grad_a = grad_b = None
        if ctx.same_input:
            if need_x:
                assert gb is not None  # computed when need_x
                grad_x = torch.addmm(torch.mm(g, weight), gb, lora_a, alpha=s).view(d.shape)
        else:
            if need_x:
                grad_x = torch.mm(g, weight).view(grad.shape[:-1] + (weight.shape[1],))
            if need_d:
                assert gb is not None  # computed when need_d
                grad_d = torch.mm(gb, lora_a).mul(s).view(d.shape)
        if need_a:
            assert gb is not None  # computed when need_a
            grad_a = torch.mm(gb.t(), d2).mul(s)  # (r, in)
        if need_b:
            grad_b = torch.mm(g.t(), torch.mm(d2, lora_a.t())).mul(s)  # (out, r)
        return grad_x, grad_d, None, None, grad_a, grad_b, None


def _peft_lora_linear() -> type:
    from peft.tuners.lora.layer import Linear

    return Linear


def gathered_elsewhere(p: torch.Tensor) -> bool:
    """Whether ``p`` is materialised by hooks this function would bypass (DeepSpeed ZeRO-3) or is sharded."""
    return hasattr(p, "ds_id") or type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor"


def _make_fused_class(base: type) -> type:
    class FusedLoraLinear(base):
        """peft's ``lora.Linear`` whose forward is :class:`LoraLinearFunction` where that is peft's arithmetic."""

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            y: torch.Tensor
            if not (args or kwargs) and not self.merged_adapters:
                if self._disable_adapters:  # peft's own path without its argument checks: the base layer alone
                    y = self.base_layer(x)
                    return y
                fused = self._fused_operands(x)
                if fused is not None:
                    weight, bias, lora_a, lora_b, scaling, dropout = fused
                    d = dropout(x) if dropout is not None else x
                    y = LoraLinearFunction.apply(x, d, weight, bias, lora_a, lora_b, scaling)
                    return y
            y = super().forward(x, *args, **kwargs)
            return y

        def _fused_operands(self, x: torch.Tensor) -> _FusedOperands | None:
            """``(W, b, A, B, scaling, dropout or None)`` when the fused function computes peft's forward, else None."""
            active = self._active_adapter
            name = active if isinstance(active, str) else (active[0] if len(active) == 1 else None)
            if (
                name is None
                or self.fan_in_fan_out
                or name not in self.lora_A
                or name in self.lora_variant
                or self.lora_bias.get(name, False)
            ):
                return None
            base_layer = self.base_layer
            if type(base_layer) is not nn.Linear:
                return None
            weight, bias = base_layer.weight, base_layer.bias
            lora_a, lora_b = self.lora_A[name].weight, self.lora_B[name].weight
            if (
                weight.requires_grad
                or (bias is not None and bias.requires_grad)
                or torch.is_autocast_enabled(x.device.type)
            ):
                return None
            if not (x.dtype == weight.dtype == lora_a.dtype == lora_b.dtype) or x.device != weight.device:
                return None
            if any(gathered_elsewhere(p) for p in (weight, lora_a, lora_b)):
                return None
            dropout = self.lora_dropout[name]
            if isinstance(dropout, nn.Identity) or not dropout.training or getattr(dropout, "p", 1.0) == 0:
                dropout = None
            elif type(dropout) is not nn.Dropout:
                return None
            return weight, bias, lora_a, lora_b, float(self.scaling[name]), dropout

    FusedLoraLinear.__qualname__ = FusedLoraLinear.__name__ = "FusedLoraLinear"
    return FusedLoraLinear


@functools.cache
def fused_class() -> type:
    """The :class:`FusedLoraLinear` class (peft's ``lora.Linear`` with the fused forward), made once."""
    return _make_fused_class(_peft_lora_linear())


def _swap_classes(model: nn.Module, old: type, new: type) -> int:
    count = 0
    for module in model.modules():
        if type(module) is old:
            module.__class__ = new  # the same parameters and state: only the forward changes
            count += 1
    return count


def fuse_lora_layers(model: nn.Module) -> int:
    """Give every peft ``lora.Linear`` in ``model`` the fused forward (in place, the parameters untouched); returns
    how many. Quantized and other LoRA layer types keep their own."""
    return _swap_classes(model, _peft_lora_linear(), fused_class())


def unfuse_lora_layers(model: nn.Module) -> int:
    """Undo :func:`fuse_lora_layers`: peft's own forward again; returns how many layers changed."""
    return _swap_classes(model, fused_class(), _peft_lora_linear())


__all__ = ["LoraLinearFunction", "fuse_lora_layers", "fused_class", "unfuse_lora_layers"]

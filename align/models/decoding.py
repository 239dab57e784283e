"""A lean incremental decoder for Llama-family causal LMs, used by the rollout sampler.

Sampling runs one forward pass per generated token. For the models RL fine-tuning starts from (and, on CPU,
for any model of modest size) the cost of such a pass is dominated by per-operation overhead rather than
arithmetic: module calls, a key/value cache that grows by concatenation, a 4D mask built on every step.
:class:`FastDecoder` runs the same computation as the Hugging Face modules with fewer operations:

* the weights are read once per rollout: query/key/value and gate/up projections are fused into one matrix
  each, and LoRA adapters are merged into that copy (the trainable parameters are not touched);
* the key/value cache is preallocated for the whole rollout and written in place;
* rotary embeddings come from the model's own rotary module (so every RoPE scaling type it supports works)
  and are applied to queries and keys in one pass;
* only the last position goes through the final norm and the output head;
* on a CPU, float32 weights are handed to oneDNN once, in its own blocked layout (prepacked), so the matrix
  products of each step do not repack them: a decoding step multiplies a few rows by every weight, where
  repacking costs as much as the product (measured on SmolLM2's shapes at 16 rows: 1.2-2.6x faster per product,
  the output head the most). oneDNN's call costs about 20 us more than a plain product, so weights under
  ``_MIN_PREPACK_ELEMENTS`` stay as they are (a tiny model's all do).

It is an exact re-expression, not an approximation: logits agree with the model's own forward to float
rounding (``tests/models/test_decoding.py`` checks prefill and every decoding step). Models it does not cover
(other architectures, quantized or sharded weights, DoRA, sliding-window attention) are reported by
:func:`fast_decoder_unsupported` and sampled through the model's ``forward`` instead.

Memory: the fused copy costs one copy of the decoder's projection weights during generation (prepacked: of
every projection and of the output head); above ``max_copy_bytes`` the sampler uses the model's own forward
instead.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.lora.layer import LoraLayer
    from transformers import PretrainedConfig

__all__ = ["FastDecoder", "fast_decoder_unsupported", "DecodeCache", "decoder_for"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


# The module layout of the supported models (transformers' Llama, Qwen2 and Mistral), as the decoder reads it;
# :func:`fast_decoder_unsupported` checks it before a model is read as a :class:`_CausalLM`.
class _Norm(Protocol):
    weight: torch.Tensor  # (H,)
    variance_epsilon: float


class _Attention(Protocol):
    head_dim: int
    scaling: float
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module


class _MLP(Protocol):
    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module


class _DecoderLayer(Protocol):
    self_attn: _Attention
    mlp: _MLP
    input_layernorm: _Norm
    post_attention_layernorm: _Norm


class _Decoder(Protocol):
    embed_tokens: nn.Embedding
    layers: Sequence[_DecoderLayer]
    norm: _Norm
    rotary_emb: nn.Module  # (x, position_ids) -> (cos, sin), each (B, t, d)


class _CausalLM(Protocol):
    config: PretrainedConfig
    model: _Decoder
    lm_head: nn.Module


def _lora_layer_type() -> type[LoraLinear] | None:
    """peft's LoRA linear layer class, if peft's LoRA layers have been imported (a model can only contain
    them then; importing peft here would pull in bitsandbytes for nothing)."""
    layer_module = sys.modules.get("peft.tuners.lora.layer")
    layer: type[LoraLinear] | None = getattr(layer_module, "Linear", None)
    return layer


def _active_lora(module: LoraLayer) -> list[str]:
    """Adapters whose delta must be added to ``module``'s base weight (empty: plain weight)."""
    if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return []
    return [name for name in module.active_adapters if name in module.lora_A]


def _linear_unsupported(module: nn.Module) -> str | None:
    lora = _lora_layer_type()
    if lora is not None and isinstance(module, lora):
        for name in _active_lora(module):
            if module.use_dora.get(name, False):
                return "DoRA adapters"
            if module.lora_bias.get(name, False):
                return "LoRA adapters with a bias"
        module = module.get_base_layer()
    if type(module) is not nn.Linear:
        return f"{type(module).__name__} projections (quantized or replaced linear layers)"
    return None


def _weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, bias)`` that ``module`` applies, with active LoRA adapters merged into a new tensor. ``module``: an
    ``nn.Linear``, or a LoRA layer over one (:func:`_linear_unsupported`)."""
    lora = _lora_layer_type()
    if lora is not None and isinstance(module, lora):
        base = cast(nn.Linear, module.get_base_layer())
        weight = base.weight
        for name in _active_lora(module):
            weight = weight + module.get_delta_weight(name).to(weight.dtype)
        return weight.detach(), None if base.bias is None else base.bias.detach()
    linear = cast(nn.Linear, module)
    return linear.weight.detach(), None if linear.bias is None else linear.bias.detach()


def _fused(modules: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    parts = [_weight(m) for m in modules]
    weight = torch.cat([w for w, _ in parts], dim=0)
    if all(b is None for _, b in parts):
        return weight, None
    biases = [b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts]
    return weight, torch.cat(biases, dim=0)


_PREPACK_PROBE: dict[str, bool] = {}
# Weights with fewer elements are not prepacked: at 16 rows a prepacked product broke even at about 150k
# elements (384 x 384) and was 0.6-0.8 of the plain one's time from 200k up; below, oneDNN's fixed cost per call
# (about 20 us more on a 2-core CPU) outweighs the repacking it saves (2-3x slower at 4k-16k elements).
_MIN_PREPACK_ELEMENTS = 2**17


def prepack_available(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be prepacked for oneDNN's linear: a float32 CPU tensor, with a torch built with
    oneDNN whose prepacked linear runs (probed once per process)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    if "ok" not in _PREPACK_PROBE:
        try:
            w, x = torch.arange(6.0).view(3, 2), torch.ones(1, 2)
            out = _prepacked_linear(x, torch.ops.mkldnn._reorder_linear_weight(w), None)
            _PREPACK_PROBE["ok"] = bool(torch.equal(out, F.linear(x, w)))
        except (AttributeError, RuntimeError, NotImplementedError):
            _PREPACK_PROBE["ok"] = False
    return _PREPACK_PROBE["ok"]


def _prepacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with a weight from ``torch.ops.mkldnn._reorder_linear_weight``."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out


def _worth_prepacking(weight: torch.Tensor) -> bool:
    return weight.numel() >= _MIN_PREPACK_ELEMENTS


def _prepack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in oneDNN's blocked layout when it is large enough to gain from it, else ``weight``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight) if _worth_prepacking(weight) else weight


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _prepacked_linear(x, weight, bias) if weight.is_mkldnn else F.linear(x, weight, bias)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover
        return False
    return isinstance(tensor, DTensor)


def _causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` inside a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def fast_decoder_unsupported(model: nn.Module) -> str | None:
    """Why :class:`FastDecoder` cannot run ``model`` (``None`` when it can)."""
    lm = _causal_lm(model)
    config = getattr(lm, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    activation = getattr(config, "hidden_act", "silu")
    if activation != "silu":
        return f"activation {activation!r}"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return "sliding-window attention layers"
    if model_type == "mistral" and getattr(config, "sliding_window", None):
        return "sliding-window attention"
    inner = getattr(lm, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "an unexpected module layout"
    if type(inner.embed_tokens) is not nn.Embedding:
        return "an adapted or replaced embedding"
    first = next(lm.parameters(), None)
    if first is not None and _is_dtensor(first):
        return "sharded parameters (FSDP)"
    # ZeRO-3 marks every parameter it partitions; whether one is gathered at this moment depends on its prefetching,
    # so the mark, not the current size, decides (the decoder snapshots weights that would be released under it).
    if first is not None and (hasattr(first, "ds_id") or first.numel() == 0):
        return "partitioned parameters (DeepSpeed ZeRO-3)"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            reason = _linear_unsupported(module)
            if reason:
                return reason
    return _linear_unsupported(cast(_CausalLM, lm).lm_head)


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    ln2: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class DecodeCache:
    """Preallocated keys and values of every layer: ``(B, H_kv, capacity, head_dim)``; ``length`` are filled."""

    def __init__(
        self,
        layers: int,
        batch: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.length = 0
        self.capacity = capacity

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place (one prompt encoded once, then sampled several times)."""
        self.keys = [k.repeat_interleave(repeats, dim=0) for k in self.keys]
        self.values = [v.repeat_interleave(repeats, dim=0) for v in self.values]


@dataclass
class DecodeOutput:
    logits: torch.Tensor  # (B, 1, V)
    past_key_values: DecodeCache


class FastDecoder:
    """Callable with the interface :func:`align.rollout.sampling.sample` expects of a causal LM.

    Build one per rollout (it snapshots the current weights) with ``capacity`` = prompt width + new tokens.
    ``prepack``: hand the weights large enough to gain from it to oneDNN in its blocked layout (see the module
    docstring); ``None``: where :func:`prepack_available` says it runs. ``prepacked`` says whether any weight was.
    """

    def __init__(self, model: nn.Module, capacity: int, prepack: bool | None = None) -> None:
        reason = fast_decoder_unsupported(model)
        if reason:
            raise ValueError(f"FastDecoder does not support this model: {reason}")
        lm = cast(_CausalLM, _causal_lm(model))  # the layout fast_decoder_unsupported checked
        inner, config = lm.model, lm.config
        first = inner.layers[0].self_attn
        self.head_dim = first.head_dim
        self.scaling = first.scaling
        self.q_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.eps = inner.norm.variance_epsilon
        self.capacity = capacity
        self.rotary = inner.rotary_emb
        with torch.no_grad():
            self.embed = inner.embed_tokens.weight.detach()
            self.norm = inner.norm.weight.detach()
            available = prepack_available(self.embed)
            if prepack and not available:
                raise ValueError("FastDecoder(prepack=True) needs float32 CPU weights and a torch built with oneDNN")
            use_prepack = available if prepack is None else prepack
            pack: Callable[[torch.Tensor], torch.Tensor] = _prepack if use_prepack else (lambda w: w)
            head, self.head_bias = _weight(lm.lm_head)
            self.head = pack(head)
            self.layers: list[_Layer] = []
            for layer in inner.layers:
                attn, mlp = layer.self_attn, layer.mlp
                qkv, qkv_bias = _fused([attn.q_proj, attn.k_proj, attn.v_proj])
                o, o_bias = _weight(attn.o_proj)
                gate_up, gate_up_bias = _fused([mlp.gate_proj, mlp.up_proj])
                down, down_bias = _weight(mlp.down_proj)
                self.layers.append(
                    _Layer(
                        layer.input_layernorm.weight.detach(),
                        pack(qkv),
                        qkv_bias,
                        pack(o),
                        o_bias,
                        layer.post_attention_layernorm.weight.detach(),
                        pack(gate_up),
                        gate_up_bias,
                        pack(down),
                        down_bias,
                    )
                )
            weights = [self.head] + [
                w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
            ]
            self.prepacked = any(w.is_mkldnn for w in weights)  # whether any weight is in oneDNN's layout
            self._linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = (
                _linear if self.prepacked else F.linear
            )

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # As the Hugging Face RMSNorm: normalise in float32, cast back, then scale.
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.eps)
        return weight * F.rms_norm(x.float(), weight.shape, None, self.eps).to(x.dtype)

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: DecodeCache | None = None,
        use_cache: bool = True,
        logits_to_keep: int = 1,
        **_: object,
    ) -> DecodeOutput:
        """``input_ids`` ``(B, t)`` new tokens; ``attention_mask`` ``(B, cached + t)``; ``position_ids`` ``(B, t)``."""
        batch, t = input_ids.shape
        x = F.embedding(input_ids, self.embed)  # (B, t, H)
        cache = past_key_values
        if cache is None:
            cache = DecodeCache(len(self.layers), batch, self.kv_heads, self.capacity, self.head_dim, x.dtype, x.device)
        start, end = cache.length, cache.length + t
        if end > cache.capacity:
            raise ValueError(f"FastDecoder: {end} positions exceed the cache capacity {cache.capacity}")
        keys_visible = attention_mask[:, :end].bool()  # (B, end)
        if t == 1:
            mask = keys_visible[:, None, None, :]  # (B, 1, 1, end)
        else:
            causal = torch.ones(t, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
            mask = causal[None] & keys_visible[:, None, :]
            # A padding query sees no key; let it see itself so its (unused) output stays finite.
            mask[:, torch.arange(t), torch.arange(start, end)] = True
            mask = mask[:, None]  # (B, 1, t, end)
        cos, sin = self.rotary(x, position_ids)  # (B, t, d)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        qk_heads = self.q_heads + self.kv_heads
        half = self.head_dim // 2
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.ln1)
            qkv = self._linear(h, layer.qkv, layer.qkv_bias)  # (B, t, (Hq + 2 Hkv) d)
            qk = qkv[..., : qk_heads * self.head_dim].view(batch, t, qk_heads, self.head_dim)
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos + rotated * sin
            q = qk[:, :, : self.q_heads].transpose(1, 2)  # (B, Hq, t, d)
            cache.keys[i][:, :, start:end] = qk[:, :, self.q_heads :].transpose(1, 2)
            cache.values[i][:, :, start:end] = (
                qkv[..., qk_heads * self.head_dim :].view(batch, t, self.kv_heads, self.head_dim).transpose(1, 2)
            )
            attn = F.scaled_dot_product_attention(
                q,
                cache.keys[i][:, :, :end],
                cache.values[i][:, :, :end],
                attn_mask=mask,
                scale=self.scaling,
                enable_gqa=self.q_heads != self.kv_heads,
            )
            x = x + self._linear(attn.transpose(1, 2).reshape(batch, t, -1), layer.o, layer.o_bias)
            h = self._rms_norm(x, layer.ln2)
            gate, up = self._linear(h, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, layer.down, layer.down_bias)
        cache.length = end
        last = self._rms_norm(x[:, -logits_to_keep:], self.norm)
        return DecodeOutput(self._linear(last, self.head, self.head_bias), cache)


def _copy_bytes(model: nn.Module, prepacked: bool = False) -> int:
    """Bytes of the weight copy a :class:`FastDecoder` of ``model`` makes (projection and output weights):
    the fused and the adapter-merged weights, and with ``prepacked`` every weight large enough to be prepacked."""
    lm = cast(_CausalLM, _causal_lm(model))

    def weight(module: nn.Module) -> torch.Tensor:
        base = cast("LoraLayer", module).get_base_layer() if hasattr(module, "get_base_layer") else module
        return cast(nn.Linear, base).weight

    def nbytes(module: nn.Module) -> int:
        return weight(module).numel() * weight(module).element_size()

    def packed(module: nn.Module) -> bool:
        return prepacked and _worth_prepacking(weight(module))

    total = nbytes(lm.lm_head) if packed(lm.lm_head) else 0
    for layer in lm.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            total += nbytes(module)
        for module in (attn.o_proj, mlp.down_proj):
            if packed(module) or (hasattr(module, "get_base_layer") and _active_lora(cast("LoraLayer", module))):
                total += nbytes(module)
    return total


def decoder_for(model: nn.Module, capacity: int, max_copy_bytes: int = 2**30) -> FastDecoder | nn.Module:
    """A :class:`FastDecoder` for ``model`` when it supports it and its weight copy fits in
    ``max_copy_bytes`` (prepacked where that runs and fits, see :class:`FastDecoder`); otherwise ``model``
    itself (sampled through its own ``forward``)."""
    if fast_decoder_unsupported(model) is not None:
        return model
    embed = cast(_CausalLM, _causal_lm(model)).model.embed_tokens  # the layout checked above
    if prepack_available(embed.weight) and _copy_bytes(model, True) <= max_copy_bytes:
        return FastDecoder(model, capacity, prepack=True)
    if _copy_bytes(model) > max_copy_bytes:
        return model
    return FastDecoder(model, capacity, prepack=False)

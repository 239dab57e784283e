"""Loading causal LMs: the embedded tiny default, a local directory, a GGUF file, or a hub id, with the options
the policy and critic share (dtype, quantization, LoRA settings).

What a model name points to, and its tokenizer, come from :mod:`align.hub`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypedDict

import torch
from torch import nn

from align.errors import AlignConfigError
from align.hub import check_model_source
from align.hub.tiny import build_tiny_model, is_tiny

if TYPE_CHECKING:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig, PreTrainedModel
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

DType = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["4bit", "8bit"]


class LoadKwargs(TypedDict):
    """How a policy loads its models (:attr:`~align.models.policy.PolicyModel.load_kwargs`), the options its critic
    and reference share: the keyword arguments of :func:`load_causal_lm` and :func:`load_decoder`."""

    dtype: DType
    trust_remote_code: bool
    revision: str | None
    attn_implementation: str | None
    seed: int


@dataclass
class LoraSettings:
    """LoRA adapter settings (Hu et al. 2021, arXiv 2106.09685), passed to peft's ``LoraConfig``."""

    where: ClassVar[str] = "model.policy.lora"
    """The settings' place in a config, named by their errors."""

    r: int = 16
    """Adapter rank."""
    alpha: int = 32
    """Scaling numerator: the update is scaled by ``alpha / r``."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] | str = "all-linear"
    """Module names to adapt, or ``all-linear`` for every linear layer except the output head."""
    bias: Literal["none", "all", "lora_only"] = "none"
    modules_to_save: list[str] | None = None
    """Extra modules trained in full and saved with the adapter (for example ``lm_head``)."""
    use_rslora: bool = False
    """Rank-stabilised scaling ``alpha / sqrt(r)`` (arXiv 2312.03732)."""
    use_dora: bool = False
    fused: bool = True
    """Compute each adapted linear layer as one autograd function (:mod:`align.models.lora`), where that is peft's
    arithmetic; false: peft's own forward everywhere."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Any other ``peft.LoraConfig`` argument."""

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise AlignConfigError(f"{self.where}.{name}: expected {expected}, got {getattr(self, name)!r}")

        check(_integer(self.r) and self.r >= 1, "r", "an integer >= 1")
        check(_number(self.alpha) and self.alpha > 0, "alpha", "> 0")
        check(_number(self.dropout) and 0 <= self.dropout < 1, "dropout", "a value in [0, 1)")
        check(
            self.target_modules == "all-linear"
            or (isinstance(self.target_modules, str) and bool(self.target_modules))
            or (
                isinstance(self.target_modules, (list, tuple))
                and len(self.target_modules) > 0
                and all(isinstance(m, str) for m in self.target_modules)
            ),
            "target_modules",
            "'all-linear' or a non-empty list of module names",
        )
        check(self.bias in ("none", "all", "lora_only"), "bias", "'none', 'all' or 'lora_only'")
        check(
            self.modules_to_save is None
            or (
                isinstance(self.modules_to_save, (list, tuple))
                and all(isinstance(m, str) for m in self.modules_to_save)
            ),
            "modules_to_save",
            "a list of module names or null",
        )
        check(isinstance(self.extra, dict), "extra", "a mapping of further peft.LoraConfig arguments")

    def to_peft(self) -> LoraConfig:
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=self.target_modules,
            bias=self.bias,
            modules_to_save=self.modules_to_save,
            use_rslora=self.use_rslora,
            use_dora=self.use_dora,
            task_type="CAUSAL_LM",
            **self.extra,
        )


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def torch_dtype(name: DType | str | torch.dtype | None) -> torch.dtype | str | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return "auto"
    try:
        return {
            "float32": torch.float32,
            "fp32": torch.float32,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "fp16": torch.float16,
        }[name]
    except KeyError:
        raise AlignConfigError(f"dtype: expected one of auto, float32, bfloat16, float16, got {name!r}") from None


def _device_map() -> dict[str, object]:
    if torch.cuda.is_available():
        return {"": int(os.environ.get("LOCAL_RANK", 0))}
    return {"": "cpu"}


def load_causal_lm(
    name: str,
    *,
    dtype: DType = "float32",
    quantization: Quantization | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    attn_implementation: str | None = None,
    seed: int = 0,
) -> PreTrainedModel:
    """Load a causal LM. ``tiny`` builds the embedded default with weights fixed by ``seed``."""
    source = check_model_source(name)
    if is_tiny(source):
        if quantization is not None:
            raise AlignConfigError(
                f"model.policy.quantization: expected null for the embedded tiny model (it is not "
                f"quantizable; use a real model path), got {quantization!r}"
            )
        model = build_tiny_model(seed=seed)
        td = torch_dtype(dtype)
        if isinstance(td, torch.dtype):
            model = model.to(td)  # type: ignore[arg-type]  # transformers' @wraps(nn.Module.to) types it unbound
        if attn_implementation:
            model.config._attn_implementation = attn_implementation
        return model

    from transformers import AutoModelForCausalLM

    extra = (
        {}
        if quantization is None
        else {"quantization_config": quantization_config(quantization, dtype), "device_map": _device_map()}
    )
    return _from_pretrained(
        AutoModelForCausalLM,
        name,
        source,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        revision=revision,
        attn_implementation=attn_implementation,
        **extra,
    )


def _from_pretrained(
    auto_class: type[_BaseAutoModelClass],
    name: str,
    source: str,
    *,
    dtype: DType,
    trust_remote_code: bool,
    revision: str | None,
    attn_implementation: str | None,
    **extra: Any,
) -> PreTrainedModel:
    """``auto_class.from_pretrained`` with the wrapper's loading options; a missing or unreadable model is one line."""
    kwargs: dict[str, Any] = {
        "trust_remote_code": trust_remote_code,
        "revision": revision,
        "dtype": torch_dtype(dtype),
        **extra,
    }
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model: PreTrainedModel = auto_class.from_pretrained(source, **kwargs)
    except OSError as err:
        raise AlignConfigError(f"model: could not load '{name}': {err}") from err
    return model


def trainable(
    base: PreTrainedModel, quantization: Quantization | None, lora: LoraSettings | None, gradient_checkpointing: bool
) -> nn.Module:
    """``base`` ready to train: a quantized base prepared for k-bit training (QLoRA), activations recomputed in the
    backward with ``gradient_checkpointing``, and the ``lora`` adapter added (its layers fused where they can be,
    :mod:`align.models.lora`)."""
    if quantization is not None:
        from peft import prepare_model_for_kbit_training

        base = prepare_model_for_kbit_training(
            base,
            use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:
        from peft import get_peft_model

        from align.models.lora import fuse_lora_layers

        adapted = get_peft_model(base, lora.to_peft())
        if lora.fused:
            fuse_lora_layers(adapted)
        return adapted
    return base


def zero_dropout(model: torch.nn.Module) -> None:
    """Set every dropout inside ``model`` to 0: ``nn.Dropout`` modules (LoRA's ``lora_dropout`` included), the float
    ``attention_dropout`` that transformers' attention layers pass to their kernels in train mode, and the dropout
    settings of every config (so modules built later from it start without)."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0  # type: ignore[assignment]  # nn.Module types attributes Tensor | Module
        config = getattr(module, "config", None)
        for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop"):
            if isinstance(getattr(config, name, None), float):
                setattr(config, name, 0.0)


def is_sequence_classifier(source: str | Path) -> bool:
    """Whether a local model directory holds a ``*ForSequenceClassification`` checkpoint (a reward model), by the
    architectures its ``config.json`` names."""
    config = Path(source) / "config.json"
    if not config.is_file():
        return False
    architectures = json.loads(config.read_text()).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in architectures)


def load_decoder(
    name: str,
    *,
    dtype: DType = "float32",
    trust_remote_code: bool = False,
    revision: str | None = None,
    attn_implementation: str | None = None,
    seed: int = 0,
) -> PreTrainedModel:
    """The decoder stack (no output head) of a causal LM or of a sequence classifier such as a reward-model
    export: the backbone of a separate critic."""
    source = check_model_source(name)
    if not is_tiny(source) and is_sequence_classifier(source):
        from transformers import AutoModelForSequenceClassification

        model = _from_pretrained(
            AutoModelForSequenceClassification,
            name,
            source,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            revision=revision,
            attn_implementation=attn_implementation,
        )
        backbone: PreTrainedModel = getattr(model, model.base_model_prefix)  # the ``*Model`` inside
        return backbone
    decoder: PreTrainedModel = load_causal_lm(
        name,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        revision=revision,
        attn_implementation=attn_implementation,
        seed=seed,
    ).get_decoder()
    return decoder


def quantization_config(quantization: Quantization, dtype: DType = "bfloat16") -> BitsAndBytesConfig:
    """bitsandbytes settings for QLoRA (Dettmers et al. 2023, arXiv 2305.14314): nf4 with double quantization."""
    from transformers import BitsAndBytesConfig

    compute = torch_dtype(dtype)
    compute = compute if isinstance(compute, torch.dtype) else torch.bfloat16
    if quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute,
        )
    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise AlignConfigError(f"model.policy.quantization: expected '4bit', '8bit' or null, got {quantization!r}")


def reward_head_state(source: str) -> dict[str, torch.Tensor] | None:
    """The scalar head of a reward model directory as a :class:`~align.models.critic.ValueHead` state dict
    (``proj.weight`` (1, H), ``proj.bias`` (1,)), or None when ``source`` is not a reward model (a plain causal LM)."""
    from safetensors import safe_open

    try:
        path = Path(check_model_source(source, what="model.policy.critic.model"))
    except AlignConfigError:
        return None
    if not path.is_dir():
        return None
    if not is_sequence_classifier(path):
        return None
    index = path / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"].get("score.weight") if index.is_file() else "model.safetensors"
    if shard is None or not (path / shard).is_file():
        return None
    with safe_open(str(path / shard), framework="pt") as f:
        if "score.weight" not in f.keys():
            return None
        weight = f.get_tensor("score.weight").float()
    if weight.shape[0] != 1:
        raise AlignConfigError(
            f"model.policy.critic.model: expected a reward model with one label, got '{source}' with {weight.shape[0]}"
        )
    return {"proj.weight": weight, "proj.bias": torch.zeros(1)}

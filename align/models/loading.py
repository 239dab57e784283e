"""Loading causal LMs and tokenizers: the embedded tiny default, a local directory, a GGUF file, or a hub id.

A hub id needs network access. Local paths are checked before anything is loaded, so a typo fails with a
message naming the path rather than a hub lookup error. A ``.gguf`` file or a packaged model id such as
``smollm2-135m-instruct`` is converted once into a cached Hugging Face folder (:mod:`align.models.gguf`) and
loaded from there.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from align.errors import AlignConfigError
from align.models.gguf import converted_dir, is_gguf_source
from align.models.tiny import TINY_SORT_DIR, build_tiny_model, has_tiny_sort_weights, is_tiny, is_tiny_sort, load_tiny_tokenizer
from align.models.tiny import TINY_SORT_RM_DIR, is_tiny_sort_rm

log = logging.getLogger(__name__)

DType = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["4bit", "8bit"]
LEGACY_HEAD_FILE = "reward_head.safetensors"
"""The reward head of a version 1 reward-model export (a causal LM folder plus this file)."""


@dataclass
class LoraSettings:
    """LoRA adapter settings (Hu et al. 2021, arXiv 2106.09685), passed to peft's ``LoraConfig``."""

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
    extra: dict = field(default_factory=dict)
    """Any other ``peft.LoraConfig`` argument."""

    def to_peft(self):
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


def torch_dtype(name: DType | str | torch.dtype | None) -> torch.dtype | str | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return "auto"
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16}[name]
    except KeyError:
        raise AlignConfigError(f"dtype: expected one of auto, float32, bfloat16, float16, got {name!r}") from None


def _is_hub_id(name: str) -> bool:
    """``org/name`` or ``name``: no leading ``.``/``/``/``~`` and at most one slash."""
    return not name.startswith((".", "/", "~")) and name.count("/") <= 1 and all(name.split("/"))


def check_model_source(name: str, what: str = "model") -> str:
    """Fail early, naming the setting, when a local model path does not exist."""
    if is_tiny(name):
        return name
    if is_tiny_sort(name):
        # The shipped SFT-warmed tiny model: a plain Hugging Face directory inside the package.
        if not has_tiny_sort_weights():
            raise AlignConfigError(f"{what}: 'tiny-sort' weights are missing from {TINY_SORT_DIR}; "
                                   "run scripts/make_tiny_sort.py to rebuild them")
        return str(TINY_SORT_DIR)
    if is_tiny_sort_rm(name):
        # The shipped sort-task reward model: a sequence-classification export directory.
        if not (TINY_SORT_RM_DIR / "config.json").is_file():
            raise AlignConfigError(f"{what}: 'tiny-sort-rm' weights are missing from {TINY_SORT_RM_DIR}; "
                                   "run scripts/make_tiny_sort_rm.py to rebuild them")
        return str(TINY_SORT_RM_DIR)
    if is_gguf_source(name):
        return str(converted_dir(name))
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").exists() and what == "model":
            raise AlignConfigError(f"{what}: '{name}' is a directory without config.json; expected a Hugging Face model directory")
        return str(path)
    if not _is_hub_id(name):
        raise AlignConfigError(
            f"{what}: '{name}' does not exist; expected a local model directory, a hub id such as "
            "'Qwen/Qwen2.5-0.5B-Instruct', a .gguf file, 'smollm2-135m-instruct' or 'tiny'"
        )
    return name


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
):
    """Load a causal LM. ``tiny`` builds the embedded default with weights fixed by ``seed``."""
    source = check_model_source(name)
    if is_tiny(source):
        if quantization is not None:
            raise AlignConfigError("quantization: the embedded tiny model is not quantizable; use a real model path")
        model = build_tiny_model(seed=seed)
        td = torch_dtype(dtype)
        if isinstance(td, torch.dtype):
            model = model.to(td)
        if attn_implementation:
            model.config._attn_implementation = attn_implementation
        return model

    from transformers import AutoModelForCausalLM

    extra = {} if quantization is None else {"quantization_config": quantization_config(quantization, dtype),
                                             "device_map": _device_map()}
    return _from_pretrained(AutoModelForCausalLM, name, source, dtype=dtype, trust_remote_code=trust_remote_code,
                            revision=revision, attn_implementation=attn_implementation, **extra)


def _from_pretrained(auto_class, name: str, source: str, *, dtype: DType, trust_remote_code: bool,
                     revision: str | None, attn_implementation: str | None, **extra):
    """``auto_class.from_pretrained`` with the wrapper's loading options; a missing or unreadable model is one line."""
    kwargs: dict = {"trust_remote_code": trust_remote_code, "revision": revision, "dtype": torch_dtype(dtype), **extra}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        return auto_class.from_pretrained(source, **kwargs)
    except OSError as err:
        raise AlignConfigError(f"model: could not load '{name}': {err}") from err


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
):
    """The decoder stack (no output head) of a causal LM or of a sequence classifier such as a reward-model
    export: the backbone of a separate critic."""
    source = check_model_source(name)
    if not is_tiny(source) and is_sequence_classifier(source):
        from transformers import AutoModelForSequenceClassification

        model = _from_pretrained(AutoModelForSequenceClassification, name, source, dtype=dtype,
                                 trust_remote_code=trust_remote_code, revision=revision,
                                 attn_implementation=attn_implementation)
        return getattr(model, model.base_model_prefix)
    return load_causal_lm(name, dtype=dtype, trust_remote_code=trust_remote_code, revision=revision,
                          attn_implementation=attn_implementation, seed=seed).get_decoder()


def quantization_config(quantization: Quantization, dtype: DType = "bfloat16"):
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
    raise AlignConfigError(f"quantization: expected '4bit', '8bit' or null, got {quantization!r}")


def load_tokenizer(name: str, *, trust_remote_code: bool = False, revision: str | None = None, pad_equals_eos: bool = False):
    """Load a tokenizer and make sure it has EOS and pad tokens.

    A tokenizer without a pad token gets its EOS as pad: every mask in ``align`` is built from positions and
    the first EOS, never from ``ids != pad``, so ``pad == eos`` is safe. One without an EOS is refused.
    """
    source = check_model_source(name, what="tokenizer")
    if is_tiny(source):
        return load_tiny_tokenizer(pad_equals_eos=pad_equals_eos)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError) as err:
        raise AlignConfigError(f"tokenizer: could not load '{name}': {err}") from err
    if tokenizer.eos_token_id is None:
        raise AlignConfigError(f"tokenizer: '{name}' has no eos_token; set one in its tokenizer_config.json")
    if tokenizer.pad_token_id is None or pad_equals_eos:
        if tokenizer.pad_token_id is None:
            log.info("tokenizer '%s' has no pad token; using its eos token %r as pad", name, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def reward_head_state(source: str) -> dict[str, torch.Tensor] | None:
    """The scalar head of a reward model directory as a :class:`~align.models.policy.ValueHead` state dict
    (``proj.weight`` (1, H), ``proj.bias`` (1,)), or None when ``source`` is not a reward model (a plain causal LM)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        path = Path(check_model_source(source, what="critic_model"))
    except AlignConfigError:
        return None
    if not path.is_dir():
        return None
    if (path / LEGACY_HEAD_FILE).is_file():
        return load_file(str(path / LEGACY_HEAD_FILE))
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
        raise AlignConfigError(f"critic_model: '{source}' has {weight.shape[0]} labels; a reward model has one")
    return {"proj.weight": weight, "proj.bias": torch.zeros(1)}

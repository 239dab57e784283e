"""Model wrapper, the embedded tiny default, loading, LoRA/QLoRA and export."""

from align.models.loading import LoraSettings, load_causal_lm, load_tokenizer
from align.models.policy import PolicyModel, TokenLogprobs

__all__ = ["LoraSettings", "PolicyModel", "TokenLogprobs", "load_causal_lm", "load_tokenizer"]

"""Model wrapper, loading, LoRA/QLoRA and export (model names and tokenizers: :mod:`align.hub`)."""

from align.hub import load_tokenizer
from align.models.critic import CriticSettings
from align.models.loading import LoraSettings, load_causal_lm
from align.models.policy import PolicyModel, TokenLogprobs

__all__ = ["CriticSettings", "LoraSettings", "PolicyModel", "TokenLogprobs", "load_causal_lm", "load_tokenizer"]

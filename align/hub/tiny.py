"""The embedded default model: a tiny Llama and the tokenizer shipped with the package.

Naming ``model: tiny`` (see :data:`TINY`) anywhere a model path or hub id is
accepted gives this model, so every recipe runs offline on a laptop CPU. It is
built from a seed rather than loaded, so no weights need to ship; the tokenizer
(``assets/tokenizer/``, made by ``scripts/train_tokenizer.py``) is a 512-entry
byte-level BPE with a chat template.

Special ids: ``<|pad|>`` = 0, ``<|bos|>`` = 1, ``<|eos|>`` = 2. The tokenizer
adds no BOS itself; the chat template emits it once at the start.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"
"""The shipped tokenizer directory; ``AutoTokenizer.from_pretrained(TOKENIZER_DIR)`` loads it."""

TINY_SORT_DIR = ASSETS_DIR / "tiny-sort"
"""SFT-warmed weights of the tiny Llama on the sort task (made by ``scripts/make_tiny_sort.py``), a
Hugging Face model directory addressed by the model id :data:`TINY_SORT`."""

TINY = "tiny"
"""The model id that means the embedded default, e.g. ``--model.policy tiny`` or ``name_or_path: tiny`` in YAML."""


TINY_SORT = "tiny-sort"
"""The model id of the SFT-warmed tiny model (:data:`TINY_SORT_DIR`): the GRPO/PPO recipes' default policy."""


TINY_SORT_RM_DIR = ASSETS_DIR / "tiny-sort-rm"
"""A reward model for the sort task (made by ``scripts/make_tiny_sort_rm.py`` with ``recipes/rm.py`` on the
bundled preferences): a reward-model export directory (see :mod:`align.models.reward_export`) addressed by the id
:data:`TINY_SORT_RM`."""

TINY_SORT_RM = "tiny-sort-rm"
"""The id of the shipped sort-task reward model (:data:`TINY_SORT_RM_DIR`): a reward for PPO, and a critic
backbone (``critic: {kind: separate, model: tiny-sort-rm}``)."""


TINY_SORT_GRPO_DIR = ASSETS_DIR / "tiny-sort-grpo"
"""``tiny-sort`` after the GRPO recipe's default run (made by ``scripts/make_tiny_sort_grpo.py``), a Hugging Face
model directory addressed by the id :data:`TINY_SORT_GRPO`: the distillation recipe's default teacher."""

TINY_SORT_GRPO = "tiny-sort-grpo"
"""The id of the shipped GRPO-trained sort model (:data:`TINY_SORT_GRPO_DIR`)."""


SHIPPED_DIRS: dict[str, Path] = {
    TINY_SORT: TINY_SORT_DIR,
    TINY_SORT_GRPO: TINY_SORT_GRPO_DIR,
    TINY_SORT_RM: TINY_SORT_RM_DIR,
}
"""The model ids whose weights ship inside the package, with their folders; each folder is rebuilt by
``scripts/make_<id with underscores>.py``."""


def shipped_dir(name: Any) -> Path | None:
    """The package folder of a shipped model id (case and surrounding spaces ignored), else None."""
    return SHIPPED_DIRS.get(name.strip().lower()) if isinstance(name, str) else None


def is_tiny_sort_rm(name: Any) -> bool:
    """Whether a model id names the shipped sort-task reward model (case and surrounding spaces ignored)."""
    return isinstance(name, str) and name.strip().lower() == TINY_SORT_RM


def is_tiny_sort(name: Any) -> bool:
    """Whether a model id names the shipped SFT-warmed tiny model (case and surrounding spaces ignored)."""
    return isinstance(name, str) and name.strip().lower() == TINY_SORT


def is_tiny(name: Any) -> bool:
    """Whether a model id names the embedded default (case and surrounding spaces ignored)."""
    return isinstance(name, str) and name.strip().lower() == TINY


def has_tiny_sort_weights() -> bool:
    """Whether SFT-warmed tiny weights ship with this install (the hook for a future loader)."""
    return (TINY_SORT_DIR / "config.json").is_file()


def load_tiny_tokenizer(pad_equals_eos: bool = False) -> PreTrainedTokenizerFast:
    """A fresh copy of the shipped tokenizer (right padding, ``model_max_length`` 512).

    With ``pad_equals_eos=True`` the pad token is the EOS token (same id, 2), as
    in many released models; tests use it to check EOS-aware masking.
    """
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(TOKENIZER_DIR))
    if pad_equals_eos:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@lru_cache(maxsize=1)
def _tokenizer_ids() -> tuple[int, int, int, int]:
    tokenizer = load_tiny_tokenizer()
    return len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id


def tiny_config(**overrides: Any) -> LlamaConfig:
    """The tiny Llama's config: 4 layers, hidden 128, 4 query / 2 key-value heads, ~0.85M parameters.

    ``overrides`` replace any field, e.g. ``tiny_config(hidden_size=512)`` for a
    wider benchmark model (``head_dim`` follows ``hidden_size // num_attention_heads``).
    """
    vocab, bos, eos, pad = _tokenizer_ids()
    fields: dict[str, Any] = dict(
        vocab_size=-(-vocab // 8) * 8,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def build_tiny_model(seed: int = 0, **config_overrides: Any) -> LlamaForCausalLM:
    """A freshly initialised tiny Llama in float32, identical for the same seed and overrides.

    Seeding happens on a forked RNG, so building a model leaves the caller's
    global torch RNG untouched. Returned in eval mode, as ``from_pretrained`` would.
    """
    config = tiny_config(**config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(torch.float32).eval()  # type: ignore[arg-type]  # transformers' @wraps'd `to` hides its signature

"""What a model name points to, and its tokenizer: the embedded tiny models (:mod:`align.hub.tiny`), a GGUF
file or packaged GGUF id (:mod:`align.hub.gguf`), a local Hugging Face directory, or a hub id.

A hub id needs network access. Local paths are checked before anything is loaded, so a typo fails with a
message naming the path rather than a hub lookup error. A ``.gguf`` file or a packaged model id such as
``smollm2-135m-instruct`` is converted once into a cached Hugging Face folder and loaded from there.

The bottom of the stack: the data modules load a tokenizer by name here, and :mod:`align.models` loads weights
by name through it, so neither imports the other for it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from align.errors import AlignConfigError
from align.hub.gguf import converted_dir, is_gguf_source
from align.hub.tiny import (
    TINY_SORT_DIR,
    TINY_SORT_GRPO_DIR,
    TINY_SORT_RM_DIR,
    has_tiny_sort_weights,
    is_tiny,
    is_tiny_sort,
    is_tiny_sort_grpo,
    is_tiny_sort_rm,
    load_tiny_tokenizer,
)

log = logging.getLogger(__name__)


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
    if is_tiny_sort_grpo(name):
        if not (TINY_SORT_GRPO_DIR / "config.json").is_file():
            raise AlignConfigError(f"{what}: 'tiny-sort-grpo' weights are missing from {TINY_SORT_GRPO_DIR}; "
                                   "run scripts/make_tiny_sort_grpo.py to rebuild them")
        return str(TINY_SORT_GRPO_DIR)
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


__all__ = ["check_model_source", "load_tokenizer"]

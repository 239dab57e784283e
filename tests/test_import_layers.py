"""The import layers of ``align``, read from the source with ``ast``.

Every import counts: at module level, inside a function, or under ``TYPE_CHECKING``. An import inside a function
is still a dependency; it only hides a cycle until the function runs.

The stack, bottom to top: data -> models -> rollout -> modules -> cli. A layer imports only the layers below
it and the side layers it is allowed (``LAYERS``): the error types, the pure math and the model names (``hub``)
are below everything; the trainer plug-ins sit beside the stack, for modules and the CLI; observability sits to
the side too: modules and the CLI may import it, nothing in math, data, models or rollout does.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import NamedTuple

import align

ROOT = Path(align.__file__).parent


class Layer(NamedTuple):
    modules: tuple[str, ...]  # dotted names; a package stands for everything inside it
    may_import: tuple[str, ...]  # other layers (a layer always imports itself)
    why: str


MATH = "math"
STACK = ("data", "models", "rollout", "modules", "cli")
LAYERS: dict[str, Layer] = {
    "errors": Layer(("align", "align.errors"), (),
                    "the package root and the user-facing error types: every layer raises them"),
    MATH: Layer(("align.logprobs", "align.kl", "align.advantages", "align.losses", "align.trust_region", "align.stats",
                 "align.packing"),
                (), "pure tensor math with pinned-value tests: torch, the standard library and each other only"),
    "hub": Layer(("align.hub",), ("errors",),
                 "what a model name points to (tiny, GGUF, local folder, hub id) and its tokenizer: data loads a "
                 "tokenizer by name and models load weights by name here, so neither needs the other for it"),
    "data": Layer(("align.data",), ("errors", MATH, "hub"),
                  "datasets, collators, data modules: the bottom of the stack; it knows tokenizers, never models"),
    "models": Layer(("align.models",), ("errors", MATH, "hub", "data"),
                    "the policy wrapper, reward model, loading and export; the reward-model scorer encodes its text "
                    "as the data layer does"),
    "rollout": Layer(("align.rollout", "align.rewards", "align.rollout_filter", "align.generation", "align.envs",
                      "align.episodes"),
                     ("errors", MATH, "hub", "data", "models"),
                     "sampling completions and scoring them (reward functions, reward models; generation and "
                     "evaluation of a trained policy), playing multi-turn episodes with environments and tools, and "
                     "stepping Gymnasium environments with a policy: no optimizer"),
    "trainer": Layer(("align.strategies", "align.checkpointing", "align.guards", "align.optim", "align.host_memory"),
                     ("errors",),
                     "trainer plug-ins (strategies, checkpoint IO and exact resume, the non-finite guard, schedules, the "
                     "host allocator's settings): "
                     "they work on any LightningModule through Lightning's hooks, so they know no model or data"),
    "observability": Layer(("align.observability",), ("errors",),
                           "OTLP export and the curves picture, to the side and the only code importing "
                           "opentelemetry or matplotlib: the modules and the CLI may import it, math, data, models "
                           "and rollout never do, so training never needs it"),
    "modules": Layer(("align.modules",),
                     ("errors", MATH, "hub", "data", "models", "rollout", "trainer", "observability"),
                     "one LightningModule per algorithm: wires the layers below together"),
    "cli": Layer(("align.cli", "align.runs", "align.quiet", "align.config_errors", "align.generation_cli"),
                 ("errors", MATH, "hub", "data", "models", "rollout", "trainer", "observability", "modules"),
                 "entry points and run folders: may import everything"),
}

# Third-party packages only some layers may import: {package: layers}.
THIRD_PARTY_ONLY_IN = {"opentelemetry": {"observability"}, "matplotlib": {"observability"}}
# The math imports nothing but these, the standard library and itself.
MATH_THIRD_PARTY = {"torch"}

# Known violations waiting for a larger change: {(importer, imported): why}. Each must still occur.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = ("align", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(name: str) -> str | None:
    """The layer of an ``align`` module: its own entry, else its nearest package's (the root only by name)."""
    best, length = None, -1
    for layer, spec in LAYERS.items():
        for prefix in spec.modules:
            exact = name == prefix
            inside = prefix != "align" and name.startswith(prefix + ".")
            if (exact or inside) and len(prefix) > length:
                best, length = layer, len(prefix)
    return best


def imports(name: str, source: str, is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in module ``name``'s source; ``from pkg import mod`` names ``pkg.mod``."""
    found = []
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if sub in MODULES else base))
    return found


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT.parent)}:{line}"


def test_every_module_has_a_layer():
    missing = sorted(name for name in MODULES if layer_of(name) is None)
    assert not missing, f"modules without a layer (add them to LAYERS in {Path(__file__).name}): {missing}"


def test_the_layers_form_no_cycle():
    done: set[str] = set()

    def visit(layer: str, path: tuple[str, ...]) -> None:
        assert layer not in path, f"layer cycle: {' -> '.join(path + (layer,))}"
        if layer not in done:
            for lower in LAYERS[layer].may_import:
                visit(lower, path + (layer,))
            done.add(layer)

    for layer in LAYERS:
        visit(layer, ())
    # The stack in order: each layer may import every one below it.
    for i, layer in enumerate(STACK):
        assert set(STACK[:i]) <= set(LAYERS[layer].may_import), layer


def test_imports_point_down_the_layers():
    violations, seen_exceptions = [], set()
    for name, path in MODULES.items():
        layer = layer_of(name)
        allowed = {layer, *LAYERS[layer].may_import}
        for line, target in imports(name, path.read_text(), path.name == "__init__.py"):
            top = target.split(".")[0]
            if top == "align":
                target_layer = layer_of(target)
                if target_layer in allowed:
                    continue
                if (name, target) in EXCEPTIONS:
                    seen_exceptions.add((name, target))
                    continue
                violations.append(f"{where(path, line)}: {name} ({layer}) imports {target} ({target_layer}); "
                                  f"{layer} may import {sorted(allowed)}")
            elif top in THIRD_PARTY_ONLY_IN and layer not in THIRD_PARTY_ONLY_IN[top]:
                violations.append(f"{where(path, line)}: {name} ({layer}) imports {target}; only "
                                  f"{sorted(THIRD_PARTY_ONLY_IN[top])} may")
            elif layer == MATH and top not in MATH_THIRD_PARTY and top not in sys.stdlib_module_names:
                violations.append(f"{where(path, line)}: {name} (math) imports {target}; the math imports only "
                                  f"{sorted(MATH_THIRD_PARTY)}, the standard library and itself")
    assert not violations, "imports against the layers:\n" + "\n".join(violations)
    stale = sorted(set(EXCEPTIONS) - seen_exceptions)
    assert not stale, f"exceptions that no longer occur (remove them from EXCEPTIONS): {stale}"


def test_the_reader_sees_every_kind_of_import():
    source = ("import align.errors\nfrom align import stats\n\n\ndef f():\n    from align.models import PolicyModel\n"
              "    from . import io\n    from ..rollout import sample\n")
    assert imports("align.data.base", source) == [(1, "align.errors"), (2, "align.stats"), (6, "align.models"),
                                                  (7, "align.data.io"), (8, "align.rollout")]
    assert imports("align.data", "from .sft import SFTDataModule\n", is_package=True) == [(1, "align.data.sft")]

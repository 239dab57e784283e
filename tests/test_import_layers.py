"""The import layers of ``align``, read from the source with ``ast``.

A layer is a folder of ``align/``: a module's layer is the first folder of its path, so a new file is layered by
where it is put. The package root holds only the error types (the bottom of everything) and the public aliases
(``align.rewards``, ``align.strategies``) that configs name and nothing inside ``align`` imports.

Every import counts: at module level, inside a function, or under ``TYPE_CHECKING``. An import inside a function
is still a dependency; it only hides a cycle until the function runs.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

import align

ROOT = Path(align.__file__).parent


class Layer(NamedTuple):
    may_import: tuple[str, ...]  # other layers (a layer always imports itself)
    why: str


BOTTOM, ALIASES, ENTRY = "root", "aliases", "entry"
LAYERS: dict[str, Layer] = {
    BOTTOM: Layer((), "the package root: the user-facing error types; every layer raises them"),
    "core": Layer((), "pure tensor math with pinned-value tests: torch, the standard library and each other only"),
    "jail": Layer(
        (BOTTOM,),
        "the jail the python tool runs code in (namespaces, a read-only root, limits) and its "
        "standalone launcher: the standard library and the root's error types only",
    ),
    "hub": Layer(
        (BOTTOM,),
        "what a model name points to (tiny, GGUF, local folder, hub id) and its tokenizer: data "
        "loads a tokenizer by name and models load weights by name here, so neither needs the other",
    ),
    "data": Layer((BOTTOM, "core", "hub"), "datasets, collators, data modules: it knows tokenizers, never models"),
    "models": Layer(
        (BOTTOM, "core", "hub", "data"),
        "the policy wrapper with its scoring, critic and reference, the reward model, loading and export",
    ),
    "observability": Layer(
        (BOTTOM,),
        "OTLP metrics and traces and the timing of a step's sections: the only code "
        "importing opentelemetry; math, data and models never need it",
    ),
    "rollout": Layer(
        (BOTTOM, "core", "hub", "data", "models", "observability", "jail"),
        "prompts to scored rollouts: rollout sources, generation engines, rewards, environment episodes "
        "and the evaluation of a trained policy; no optimizer",
    ),
    "trainer": Layer(
        (BOTTOM,),
        "trainer plug-ins (strategies, checkpoint IO and exact resume, the non-finite guard, "
        "optimizers and schedules, host memory, the progress bar): they work on any "
        "LightningModule through Lightning's hooks, so they know no model or data",
    ),
    "modules": Layer(
        (BOTTOM, "core", "hub", "data", "models", "rollout", "trainer", "observability"),
        "one LightningModule per algorithm over the sampler and the learner",
    ),
    "gym": Layer(
        (BOTTOM, "core", "trainer", "observability", "modules", "rollout"),
        "classic RL on Gymnasium, a wing of its own: the only code importing gymnasium; nothing imports it",
    ),
    "cli": Layer(
        (BOTTOM, "core", "hub", "data", "models", "rollout", "trainer", "observability", "modules"),
        "entry points, run folders, config errors and pictures of runs: may import everything but the gym "
        "wing (recipes/gym.py imports that)",
    ),
    ALIASES: Layer(("rollout", "trainer"), "public import paths that configs name, aliases of their new homes"),
    ENTRY: Layer(("cli",), "python -m align: the align command, nothing of its own"),
}
ROOT_MODULES = {
    "align": BOTTOM,
    "align.errors": BOTTOM,
    "align.rewards": ALIASES,
    "align.strategies": ALIASES,
    "align.__main__": ENTRY,
}
MAX_ROOT_FILES = 6
MAX_LINES = 450

# Third-party packages only some layers may import: {package: layers}.
THIRD_PARTY_ONLY_IN = {
    "opentelemetry": {"observability"},
    "matplotlib": {"cli"},
    "gymnasium": {"gym"},
    "openenv": {"rollout"},
    "verifiers": {"rollout"},
}
# The math imports nothing but these, the standard library and itself.
MATH_THIRD_PARTY = {"torch"}
# Layers that import no third-party package at all: the standard library, the root and themselves.
STANDARD_LIBRARY_ONLY = {"jail"}


def module_name(path: Path) -> str:
    parts = ("align", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(name: str) -> str | None:
    """The layer of an ``align`` module: its folder under ``align/``, or the root module's own entry."""
    if name in ROOT_MODULES:
        return ROOT_MODULES[name]
    folder = name.split(".")[1]
    return folder if folder in LAYERS and (ROOT / folder).is_dir() else None


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
    assert not missing, f"modules outside the layer folders (put them in one, see {Path(__file__).name}): {missing}"


def test_every_layer_is_a_folder_with_a_docstring():
    for layer in LAYERS:
        if layer in (BOTTOM, ALIASES, ENTRY):
            continue
        init = ROOT / layer / "__init__.py"
        assert init.is_file(), f"align/{layer}/ has no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "\n" not in doc.strip(), f"align/{layer}/__init__.py: expected a one-line docstring"


def test_the_root_stays_small():
    files = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(files) <= MAX_ROOT_FILES, f"{len(files)} files at the root of align/ (at most {MAX_ROOT_FILES}): {files}"
    assert {module_name(ROOT / f) for f in files} <= set(ROOT_MODULES), files


def test_no_file_is_too_long():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


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
    importers = {lower for layer, spec in LAYERS.items() for lower in spec.may_import}
    assert "gym" not in importers and ALIASES not in importers


def test_imports_point_down_the_layers():
    violations = []
    for name, path in MODULES.items():
        layer = layer_of(name)
        allowed = {layer, *LAYERS[layer].may_import}
        for line, target in imports(name, path.read_text(), path.name == "__init__.py"):
            top = target.split(".")[0]
            if top == "align":
                target_layer = layer_of(target)
                if target_layer not in allowed:
                    violations.append(
                        f"{where(path, line)}: {name} ({layer}) imports {target} ({target_layer}); "
                        f"{layer} may import {sorted(allowed)}"
                    )
            elif top in THIRD_PARTY_ONLY_IN and layer not in THIRD_PARTY_ONLY_IN[top]:
                violations.append(
                    f"{where(path, line)}: {name} ({layer}) imports {target}; only "
                    f"{sorted(THIRD_PARTY_ONLY_IN[top])} may"
                )
            elif layer == "core" and top not in MATH_THIRD_PARTY and top not in sys.stdlib_module_names:
                violations.append(
                    f"{where(path, line)}: {name} (core) imports {target}; the math imports only "
                    f"{sorted(MATH_THIRD_PARTY)}, the standard library and itself"
                )
            elif layer in STANDARD_LIBRARY_ONLY and top not in sys.stdlib_module_names:
                violations.append(
                    f"{where(path, line)}: {name} ({layer}) imports {target}; {layer} imports only the "
                    "standard library, the root and itself"
                )
    assert not violations, "imports against the layers:\n" + "\n".join(violations)


def test_no_module_cycle():
    """No two modules import each other, directly or through others (a layer may import itself, not in a circle)."""
    graph = {
        name: {t for _, t in imports(name, path.read_text(), path.name == "__init__.py") if t in MODULES}
        for name, path in MODULES.items()
    }
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for target in sorted(graph[name]):
            if target.startswith(name + ".") or name.startswith(target + "."):
                continue  # a package and its own modules
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(target) :] + [target]))
            if target not in state:
                visit(target)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_importing_align_installs_no_import_hook():
    # A fresh interpreter: the finders on sys.meta_path before and after ``import align``.
    import subprocess

    code = (
        "import sys\nbefore = list(sys.meta_path)\nimport align\n"
        "print([type(f).__module__ for f in sys.meta_path if f not in before])"
    )
    added = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert added == "[]", f"import align added finders to sys.meta_path: {added}"
    # Nor any of align's in this process, whatever it has imported of align by now.
    assert not [f for f in sys.meta_path if type(f).__module__.split(".")[0] == "align"], sys.meta_path


def test_there_is_no_table_of_moved_modules():
    # Read from the package's folder: an editable install of another checkout could still find an align.moved.
    assert not (ROOT / "moved.py").exists() and "align.moved" not in MODULES
    import subprocess

    code = "import sys\nimport align\nprint(sorted(m for m in sys.modules if m.startswith('align')))"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "['align']"
    ), "import align must import no module of its own"


def test_the_reader_sees_every_kind_of_import():
    source = (
        "import align.errors\nfrom align.core import stats\n\n\ndef f():\n    from align.models import PolicyModel\n"
        "    from . import io\n    from ..rollout import engine\n"
    )
    assert imports("align.data.base", source) == [
        (1, "align.errors"),
        (2, "align.core.stats"),
        (6, "align.models"),
        (7, "align.data.io"),
        (8, "align.rollout.engine"),
    ]
    assert imports("align.data", "from .sft import SFTDataModule\n", is_package=True) == [(1, "align.data.sft")]


MAX_LIGHTNING_MODULE_LINES = 300
MAX_PPO_LINES = 250
MAX_RL_MODULE_LINES = 260


def _class_lines(cls) -> int:
    import inspect

    return len(inspect.getsourcelines(cls)[0])


def test_lightning_modules_stay_small():
    """A LightningModule holds the Lightning side of one algorithm; what grows past a few hundred lines belongs in a
    shared part (the sampler, the learner, the tables). PPO, the largest algorithm, stays under 250."""
    import importlib
    import inspect

    import lightning as L

    long = {}
    for name in MODULES:
        if layer_of(name) not in ("modules", "gym"):
            continue
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name and issubclass(cls, L.LightningModule):
                if (n := _class_lines(cls)) > MAX_LIGHTNING_MODULE_LINES:
                    long[f"{name}.{cls.__name__}"] = n
    assert not long, f"LightningModules over {MAX_LIGHTNING_MODULE_LINES} lines: {long}"

    assert len(MODULES["align.modules.ppo"].read_text().splitlines()) <= MAX_PPO_LINES


def test_the_policy_wrapper_stays_small():
    from align.models.policy import PolicyModel

    assert _class_lines(PolicyModel) <= MAX_LIGHTNING_MODULE_LINES


@pytest.mark.parametrize(
    "path",
    [
        "align.modules.grpo.GRPOModule",
        "align.modules.ppo.PPOModule",
        "align.modules.SFTModule",
        "align.models.PolicyModel",
        "align.data.prompts.PromptDataModule",
        "align.data.preference.PreferenceDataModule",
        "align.rewards.math_answer",
        "align.rewards.sort_exact_match",
        "align.rewards.RewardModelScorer",
        "align.strategies.FSDP2Strategy",
        "align.strategies.DeepSpeedZeROStrategy",
        "align.rollout.source.FilteredSource",
        "align.gym.PPOGymModule",
    ],
)
def test_the_paths_users_write_in_configs_import(path):
    import importlib

    module, _, name = path.rpartition(".")
    assert getattr(importlib.import_module(module), name) is not None


SCORING = {
    "token_logprobs",
    "next_token_logprobs",
    "response_logits",
    "values",
    "reference_logprobs",
    "sequence_logps",
    "sequence_scores",
}
"""Ways of scoring rows: the scorer's (``align.models.scorer.Scorer``) alone, for every module."""


def _calls(path: Path) -> list[tuple[str, str, int]]:
    """``(receiver, attribute, line)`` of every ``receiver.attribute(...)`` call in ``path`` (the receiver's last name:
    ``self.sampler.x()`` -> ``("sampler", "x")``, ``self.x()`` -> ``("self", "x")``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = node.func.value
            name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
            out.append((name, node.func.attr, node.lineno))
    return out


def test_modules_score_through_the_scorer():
    """A training step goes module -> scorer -> scoring -> core: no module asks the sampler (the rollout layer) or
    the policy's scoring entry points directly for log-probs, reference log-probs or values, and the sampler offers
    none."""
    from align.rollout.sampler import Sampler

    bad = [
        f"{name}:{line} {receiver}.{attr}()"
        for name, path in MODULES.items()
        if layer_of(name) == "modules"
        for receiver, attr, line in _calls(path)
        if attr in SCORING and receiver not in ("scorer", "self") or receiver == "sampler" and attr in SCORING
    ]
    assert not bad, f"modules scoring past the scorer: {bad}"
    assert not SCORING & set(dir(Sampler)), "the sampler scores rows for the learner; the scorer does"


def test_the_learner_takes_what_it_uses():
    """``align/modules/learner.py`` calls nothing back but the loss function it is given: none of its functions
    takes a module (a parameter named ``module``, or a LightningModule type), and it imports no module class."""
    tree = ast.parse(MODULES["align.modules.learner"].read_text())
    params = [
        a
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs
    ]
    bad = [
        a.arg
        for a in params
        if a.arg == "module"
        or a.annotation is not None
        and any(word in ast.unparse(a.annotation) for word in ("Module", "RLModule", "AlignModule", "LightningModule"))
    ]
    assert not bad, f"learner functions that take a module: {bad}"
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith(("align.modules.rl", "align.modules.base", "lightning"))
        for alias in node.names
    }
    assert not imported, f"the learner imports module classes: {imported}"


def test_the_rl_base_module_has_headroom():
    from align.modules.rl import RLModule

    assert _class_lines(RLModule) <= MAX_RL_MODULE_LINES

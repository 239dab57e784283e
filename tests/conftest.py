import os

# Tests never reach a hub: every model and tokenizer is built locally or shipped in the package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Several test workers (pytest-xdist) on these cores: one thread each, for them and the runs they start, unless set.
# torch's default (a thread per core) in every worker oversubscribes the cores, and its spinning threads then take
# several times longer than the same tests one after another.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def installed_align() -> str | None:
    """Where a fresh interpreter started outside the checkout imports ``align`` from (as a recipe script or
    ``python -m align`` started by a test does), or None when it cannot import it."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as empty:
        done = subprocess.run(
            [sys.executable, "-c", "import align; print(align.__file__)"], cwd=empty, capture_output=True, text=True
        )
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def pytest_sessionstart(session):
    """Stop before any test when the ``align`` that subprocesses import is not this checkout's: the recipe and
    command-line tests would run another copy's code (or fail to import it) while the in-process tests run this one."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller checks, once
    found = installed_align()
    expected = REPO / "align" / "__init__.py"
    if found is None or Path(found).resolve() != expected.resolve():
        where = f"from {Path(found).parent}" if found else "nowhere (not installed)"
        pytest.exit(f'align is imported {where}, not from this checkout {REPO}: run pip install -e ".[dev]" here', 2)


MAX_WORKERS = 4  # each worker holds torch, transformers, Lightning and at times a vLLM engine: a few GB


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject.toml's addopts): one worker per core this process may run on, at most ``MAX_WORKERS``;
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` sets the number."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run on CUDA, or on the device ``ALIGN_TEST_DEVICE`` names (``cpu`` checks them on any
    machine); without either they are skipped."""
    if os.environ.get("ALIGN_TEST_DEVICE"):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (or ALIGN_TEST_DEVICE=cpu to run it on the CPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def two_threads():
    """torch computes on 2 threads for the test (the thread count is restored after it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def load_script():
    """Import a file from scripts/ in-process (a fresh interpreter would spend most of a test importing torch)."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"_script_{name}", REPO / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The tiny model (seed 3) and tokenizer saved as an ordinary Hugging Face directory: a stand-in for a real
    checkpoint wherever a local path or hub id is expected."""
    from align.hub.tiny import build_tiny_model, load_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-hf")
    build_tiny_model(seed=3).save_pretrained(path)
    load_tiny_tokenizer().save_pretrained(path)
    return str(path)


class PrivateAPI:
    """Checks on the private Lightning and torch names that ``align`` relies on (underscore attributes, internal
    modules, overridden private hooks). An upgrade may remove or change them without notice; these checks fail
    naming the API and its user, instead of a distant symptom (or, where the code tolerates its absence, none)."""

    @staticmethod
    def name_of(owner) -> str:
        if isinstance(owner, type) or callable(owner) and hasattr(owner, "__qualname__"):
            return f"{owner.__module__}.{owner.__qualname__}"
        if hasattr(owner, "__name__"):  # a module
            return owner.__name__
        return f"{type(owner).__module__}.{type(owner).__qualname__} instance"

    def require(self, owner, name: str, params: tuple[str, ...] | None = None, *, used_by: str):
        """``owner.name``, failing when it is gone, or (``params`` given) when its parameters are not ``params``."""
        import inspect

        api = f"{self.name_of(owner)}.{name}"
        missing = object()
        value = getattr(owner, name, missing)
        assert value is not missing, f"private API {api} is gone; {used_by} relies on it"
        if params is not None:
            actual = tuple(inspect.signature(value).parameters)
            assert actual == params, f"private API {api} now takes {actual}, expected {params}; {used_by} relies on it"
        return value

    def called_by(self, caller, name: str, *, used_by: str) -> None:
        """Fail when ``caller``'s source no longer mentions ``name``: an override of a hook nobody calls, or a state
        nobody fills, is dead."""
        import inspect

        assert name in inspect.getsource(caller), (
            f"{self.name_of(caller)} no longer uses private API {name}; {used_by} relies on it"
        )


@pytest.fixture(scope="session")
def private_api() -> PrivateAPI:
    return PrivateAPI()

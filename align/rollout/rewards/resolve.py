"""Import paths to objects, and exceptions back to the user's code.

:func:`resolve_import` finds what a config names by import path (``pkg.mod.name``, ``file.py:name``; a reward, an
environment, a tool), the working directory included. :func:`error_location` names the file and line where the
user's code raised, for one-line errors.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from align.errors import AlignConfigError

RewardFn = Callable[..., Sequence[float]]
# The ``align`` package: its frames are never the user's code.
_ALIGN_DIR = Path(__file__).resolve().parents[2]


def _load_file(path_text: str, attr: str, spec_text: str, what: str = "reward") -> Any:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise AlignConfigError(
            f"{what} '{spec_text}': file '{path}' does not exist (paths are relative to the "
            f"working directory {Path.cwd()})"
        )
    module_name = f"_align_{what.replace(' ', '_')}_{abs(hash(str(path.resolve())))}"
    module = sys.modules.get(module_name)
    if module is None:
        # The file imports its sibling modules as it would when run as a script, and the working directory's
        # modules as the dotted form does (both appended: neither shadows an installed package).
        _importable(str(path.resolve().parent))
        _cwd_importable()
        spec = importlib.util.spec_from_file_location(module_name, path)
        # Only ``.py`` paths come here (resolve_import), and those always get a spec with a source loader.
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - user code may raise anything on import
            raise AlignConfigError(
                f"{what} '{spec_text}': importing '{path}' failed: {type(err).__name__}: {err}"
            ) from err
        sys.modules[module_name] = module
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise AlignConfigError(f"{what} '{spec_text}': '{path}' has no attribute '{attr}' (callables there: {public})")
    return getattr(module, attr)


def _cwd_importable() -> None:
    """Make modules in the working directory importable, as ``python -m`` would: ``python recipes/grpo.py`` and
    the ``align`` script put their own folder on ``sys.path``, not the working directory. It goes last, so a
    file there never shadows an installed package. The extra ranks of ``--trainer.devices N`` re-run the same
    command in the same working directory and come through here too."""
    _importable(os.getcwd())


def _importable(folder: str) -> None:
    """Append ``folder`` to ``sys.path`` unless it is there already."""
    if not any(os.path.realpath(p or os.curdir) == os.path.realpath(folder) for p in sys.path):
        sys.path.append(folder)


def _load_dotted(path: str, what: str = "reward") -> Any:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise AlignConfigError(
            f"{what} '{path}': expected an import path such as 'align.rewards.sort_exact_match' "
            "or 'my_rewards.py:my_fn'"
        )
    _cwd_importable()
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise AlignConfigError(
            f"{what} '{path}': cannot import module '{module_name}' ({err}; searched the "
            f"installed packages and the working directory {os.getcwd()})"
        ) from err
    except Exception as err:  # noqa: BLE001 - user code may raise anything on import
        raise AlignConfigError(
            f"{what} '{path}': importing module '{module_name}' failed: "
            f"{type(err).__name__}: {err}{error_location(err, None)}"
        ) from err
    if not hasattr(module, attr):
        raise AlignConfigError(f"{what} '{path}': module '{module_name}' has no attribute '{attr}'")
    return getattr(module, attr)


def resolve_import(fn: str | Any, what: str = "reward") -> Any:
    """The object named by an import path (``pkg.mod.name`` or ``file.py:name``); a non-string is returned as is.
    Errors name the path as ``<what> '<path>'``.

    A dotted path also finds modules in the working directory (``my_rewards.fn`` for ``./my_rewards.py``). A file
    path's module imports the modules beside it (``from helpers import x`` in ``envs/game.py`` finds
    ``envs/helpers.py``) and those of the working directory, as the dotted form does."""
    if not isinstance(fn, str):
        return fn
    text = fn.strip()
    if not text:
        raise AlignConfigError(f"{what}: expected an import path string, got {fn!r}")
    if ":" in text:
        module_part, _, attr = text.rpartition(":")
        if module_part.endswith(".py"):
            return _load_file(module_part, attr, text, what)
        return _load_dotted(f"{module_part}.{attr}", what)
    return _load_dotted(text, what)


def resolve_reward(fn: str | RewardFn) -> RewardFn:
    """The callable named by an import path (``pkg.mod.fn`` or ``file.py:fn``); a callable is returned as is.

    A dotted path also finds modules in the working directory (``my_rewards.fn`` for ``./my_rewards.py``)."""
    if callable(fn):
        return fn
    if not isinstance(fn, str) or not fn.strip():
        raise AlignConfigError(f"reward: expected an import path string or a callable, got {fn!r}")
    target = resolve_import(fn)
    if not callable(target):
        raise AlignConfigError(f"reward '{fn.strip()}': resolves to a {type(target).__name__}, not a callable")
    return target


def _target(fn: Any) -> Any:
    """The Python function whose code runs when ``fn`` is called: through partials, bound methods and ``__call__``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.isroutine(fn):
        return inspect.unwrap(getattr(fn, "__func__", fn))
    call = getattr(type(fn), "__call__", None)  # noqa: B004  (the method itself, to unwrap its decorators)
    return inspect.unwrap(call) if call is not None else fn


def _qualname(fn: Any) -> str:
    """``module-level name`` of a function, ``Class.__call__`` of an instance, ``partial(fn)`` of a partial."""
    if isinstance(fn, functools.partial):
        return f"partial({_qualname(fn.func)})"
    if isinstance(fn, type) or inspect.isroutine(fn):
        return getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
    return f"{type(fn).__qualname__}.__call__"


def _source_file(fn: Any) -> str | None:
    code = getattr(_target(fn), "__code__", None)
    return os.path.realpath(code.co_filename) if code is not None else None


def _shown_path(filename: str) -> str:
    """A path relative to the working directory when it lies below it, else absolute."""
    path = os.path.realpath(filename)
    rel = os.path.relpath(path, os.getcwd())
    return path if rel.startswith(os.pardir) else rel


_LIBRARY_DIRS = tuple(
    {
        os.path.join(os.path.realpath(sysconfig.get_paths()[key]), "")
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
    }
    | {os.path.join(os.path.realpath(_ALIGN_DIR), "")}
)
"""Folders whose frames are not the user's code: the standard library, installed packages and align itself."""


def error_location(err: BaseException, fn: Any) -> str:
    """`` at FILE, line N`` where ``err`` was raised in the user's code: the innermost frame of its traceback
    outside the standard library, installed packages and align itself, else the innermost frame in the reward's
    own file (a built-in reward), else nothing."""
    frames = traceback.extract_tb(err.__traceback__)
    own = _source_file(fn) if fn is not None else None

    def is_user(frame) -> bool:
        path = os.path.realpath(frame.filename)
        return not frame.filename.startswith("<") and not path.startswith(_LIBRARY_DIRS)

    chosen = next((f for f in reversed(frames) if is_user(f)), None) or next(
        (f for f in reversed(frames) if own and os.path.realpath(f.filename) == own), None
    )
    if chosen is None:
        return ""
    # A comprehension has its own frame (``<listcomp>``): name the function it runs in.
    outer = frames[: frames.index(chosen) + 1]
    name = next((f.name for f in reversed(outer) if f.filename == chosen.filename and not f.name.startswith("<")), None)
    return f" at {_shown_path(chosen.filename)}, line {chosen.lineno}" + (f" in {name}()" if name else "")


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 200 else text[:197] + "..."

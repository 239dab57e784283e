"""Reward functions: plain callables named by import path, combined with weights, checked on every call.

A reward function has the signature (docs/rewards.md)::

    def my_reward(prompts: list[str], completions: list[str], **columns) -> list[float]: ...

``prompts[i]`` is the i-th prompt as written in the data (for a list of messages, the content of its last
message), ``completions[i]`` the decoded response, and every extra dataset column arrives as a keyword
argument holding one value per completion (``answer=[...]``). Accept ``**kwargs`` to ignore columns you do
not use. A YAML config names a function by import path::

    rewards:
      - fn: align.rewards.sort_exact_match        # a module attribute
      - fn: my_rewards.py:brevity                 # a function in a file (relative to the working directory)
        weight: 0.1

The total reward of a completion is ``sum(weight * reward)``; each reward is also logged on its own as
``rollout/reward/<name>``. Any value that is NaN or infinite, a result of the wrong length, or an exception
raised inside a reward function stops the run with a :class:`RewardError` that names the function and the
offending sample. An import path that does not resolve fails when the module is built, before training.

Built-in rewards: :func:`sort_exact_match` and :func:`sort_format` for the bundled sort task
(:mod:`align.data.sort_task`), and :func:`math_answer` for GSM8K-style math answers. A trained reward model
is a reward too: :class:`RewardModelScorer` (defined in :mod:`align.models.reward`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Sequence

from align.data import sort_task
from align.errors import AlignConfigError, AlignError
from align.models.reward import RewardModelScorer

__all__ = [
    "RewardError",
    "RewardSpec",
    "RewardFunction",
    "CombinedReward",
    "resolve_reward",
    "sort_exact_match",
    "sort_format",
    "math_answer",
    "extract_final_number",
    "RewardModelScorer",
]

RewardFn = Callable[..., Sequence[float]]


class RewardError(AlignError):
    """A reward function failed: it raised, returned a non-finite value or a result of the wrong length."""


# ----------------------------------------------------------------------------
# resolving and combining
# ----------------------------------------------------------------------------


@dataclass
class RewardSpec:
    """One reward in a run's config."""

    fn: str
    """Import path: ``package.module.function`` or ``path/to/file.py:function``."""
    weight: float = 1.0
    """Weight of this reward in the total."""
    name: str | None = None
    """Metric name (``rollout/reward/<name>``); defaults to the function's name."""
    kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments passed on every call (for example a tolerance)."""
    init_kwargs: dict | None = None
    """When ``fn`` names a class (such as ``align.rewards.RewardModelScorer``), it is built once with these
    arguments and the instance is the reward."""


def _load_file(path_text: str, attr: str, spec_text: str) -> Any:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise AlignConfigError(f"reward '{spec_text}': file '{path}' does not exist (paths are relative to the "
                               f"working directory {Path.cwd()})")
    module_name = f"_align_reward_{abs(hash(str(path.resolve())))}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - user code may raise anything on import
            raise AlignConfigError(f"reward '{spec_text}': importing '{path}' failed: {type(err).__name__}: {err}") from err
        sys.modules[module_name] = module
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise AlignConfigError(f"reward '{spec_text}': '{path}' has no attribute '{attr}' (callables there: {public})")
    return getattr(module, attr)


def _load_dotted(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise AlignConfigError(f"reward '{path}': expected an import path such as 'align.rewards.sort_exact_match' "
                               "or 'my_rewards.py:my_fn'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise AlignConfigError(f"reward '{path}': cannot import module '{module_name}' ({err})") from err
    if not hasattr(module, attr):
        raise AlignConfigError(f"reward '{path}': module '{module_name}' has no attribute '{attr}'")
    return getattr(module, attr)


def resolve_reward(fn: str | RewardFn) -> RewardFn:
    """The callable named by an import path (``pkg.mod.fn`` or ``file.py:fn``); a callable is returned as is."""
    if callable(fn):
        return fn
    if not isinstance(fn, str) or not fn.strip():
        raise AlignConfigError(f"reward: expected an import path string or a callable, got {fn!r}")
    text = fn.strip()
    if ":" in text:
        module_part, _, attr = text.rpartition(":")
        if module_part.endswith(".py"):
            target = _load_file(module_part, attr, text)
        else:
            target = _load_dotted(f"{module_part}.{attr}")
    else:
        target = _load_dotted(text)
    if not callable(target):
        raise AlignConfigError(f"reward '{text}': resolves to a {type(target).__name__}, not a callable")
    return target


def _preview(text: Any, limit: int = 60) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RewardFunction:
    """A resolved reward with its weight and metric name; calling it checks the result."""

    def __init__(self, spec: RewardSpec | str | RewardFn):
        if isinstance(spec, str):
            spec = RewardSpec(fn=spec)
        if isinstance(spec, RewardSpec):
            self.fn: RewardFn = resolve_reward(spec.fn)
            self.path = spec.fn
            if isinstance(self.fn, type):
                try:
                    self.fn = self.fn(**(spec.init_kwargs or {}))
                except TypeError as err:
                    raise AlignConfigError(f"reward '{spec.fn}': cannot build it from init_kwargs "
                                           f"{spec.init_kwargs or {}}: {err}") from err
            elif spec.init_kwargs:
                raise AlignConfigError(f"reward '{spec.fn}': init_kwargs are for a class; pass per-call arguments "
                                       "in kwargs instead")
        elif callable(spec):
            self.fn, self.path = spec, getattr(spec, "__qualname__", type(spec).__name__)
            spec = RewardSpec(fn=self.path)
        else:
            raise AlignConfigError(f"reward: expected an import path, a RewardSpec or a callable, got {spec!r}")
        self.weight = float(spec.weight)
        if not math.isfinite(self.weight):
            raise AlignConfigError(f"reward '{spec.fn}': weight must be finite, got {self.weight}")
        self.name = spec.name or (self.fn.__name__ if inspect.isroutine(self.fn) else type(self.fn).__name__)
        self.kwargs = dict(spec.kwargs)

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float]:
        where = f"reward '{self.name}' ({self.path})"
        try:
            values = self.fn(prompts, completions, **columns, **self.kwargs)
        except RewardError:
            raise
        except Exception as err:  # noqa: BLE001 - user code; re-raised with context
            raise RewardError(f"{where} raised {type(err).__name__}: {err} (on a batch of {len(completions)} "
                              f"completions; first prompt {_preview(prompts[0] if prompts else None)}, first "
                              f"completion {_preview(completions[0] if completions else None)})") from err
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError) as err:
            raise RewardError(f"{where} must return a list of numbers, got {_preview(values)}") from err
        if len(values) != len(completions):
            raise RewardError(f"{where} returned {len(values)} values for {len(completions)} completions; "
                              "return one float per completion")
        for i, v in enumerate(values):
            if not math.isfinite(v):
                raise RewardError(f"{where} returned {v} for sample {i} (prompt {_preview(prompts[i])}, "
                                  f"completion {_preview(completions[i])}); rewards must be finite")
        return values


class CombinedReward:
    """The weighted sum of several rewards, with each one's values kept for metrics."""

    def __init__(self, rewards: Sequence[RewardSpec | str | RewardFn]):
        if not rewards:
            raise AlignConfigError("rewards: give at least one reward function")
        self.rewards = [r if isinstance(r, RewardFunction) else RewardFunction(r) for r in rewards]
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise AlignConfigError(f"rewards: metric names must be unique, got {names}; set 'name' on duplicates")

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> tuple[list[float], dict[str, list[float]]]:
        """``(total, {name: values})``: the weighted total and each reward's own values, per completion."""
        parts = {r.name: r(prompts, completions, **columns) for r in self.rewards}
        total = [sum(r.weight * parts[r.name][i] for r in self.rewards) for i in range(len(completions))]
        return total, parts


# ----------------------------------------------------------------------------
# built-in rewards
# ----------------------------------------------------------------------------


def sort_exact_match(prompts: list[str], completions: list[str], answer: Sequence[str] | None = None,
                     **_: Any) -> list[float]:
    """1.0 when the completion is exactly the sorted letters, else 0.0 (the bundled sort task).

    Uses the ``answer`` column when the data has one, else solves the prompt.
    """
    answers = list(answer) if answer is not None else [sort_task.solve(p) for p in prompts]
    return [1.0 if sort_task.is_correct(c, a) else 0.0 for c, a in zip(completions, answers)]


def sort_format(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """1.0 when the completion is as many single letters as the prompt, separated by spaces, right or wrong."""
    return [1.0 if sort_task.is_well_formed(c, p) else 0.0 for p, c in zip(prompts, completions)]


_NUMBER = r"-?[\d,]*\.?\d+(?:/\d+)?"
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def extract_final_number(text: str) -> Fraction | None:
    """The final numeric answer of a solution: after ``####``, else inside the last ``\\boxed{}``, else the
    last number in the text. Thousands separators and a trailing period are ignored; ``3/4`` is a fraction.
    Returns ``None`` when there is no number."""
    match = _HASHES.search(text)
    candidate = match.group(1) if match else None
    if candidate is None:
        boxed = _BOXED.findall(text)
        if boxed:
            numbers = _ANY_NUMBER.findall(boxed[-1])
            candidate = numbers[-1] if numbers else None
    if candidate is None:
        numbers = _ANY_NUMBER.findall(text)
        candidate = numbers[-1] if numbers else None
    if candidate is None:
        return None
    try:
        return Fraction(candidate.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def math_answer(prompts: list[str], completions: list[str], answer: Sequence[str] | None = None,
                **_: Any) -> list[float]:
    """1.0 when the completion's final number equals the reference answer's, numerically, else 0.0.

    The ``answer`` column may be a bare number or a full GSM8K solution ending in ``#### <number>``.
    """
    if answer is None:
        raise ValueError("math_answer needs an 'answer' column in the prompt data")
    out = []
    for completion, reference in zip(completions, answer):
        expected = extract_final_number(str(reference))
        got = extract_final_number(completion)
        out.append(1.0 if expected is not None and got is not None and got == expected else 0.0)
    return out

"""Reward functions: plain callables named by import path, combined with weights, checked on every call.

A reward function has the signature (docs/rewards.md)::

    def my_reward(prompts: list[str], completions: list[str], **columns) -> list[float]: ...

and is called with keyword arguments only: ``prompts[i]`` is the i-th prompt as written in the data (for a
list of messages, the content of its last message), ``completions[i]`` the decoded response, every extra
dataset column arrives under its own name with one value per completion (``answer=[...]``), and so do the
rollout's inputs ``prompt_messages``, ``completion_ids`` and ``completion_truncated``. TRL's form
``def reward(completions, **kwargs)`` therefore works as is. A function without ``**kwargs`` receives only
the arguments its signature names; one that requires an argument nobody provides fails before the first
rollout. A YAML config names a function by import path::

    rewards:
      - fn: align.rewards.sort_exact_match        # a module attribute
      - fn: my_rewards.brevity                    # ./my_rewards.py: the working directory is importable
        weight: 0.1
      - fn: checks/style.py:politeness            # a function in a file (relative to the working directory)

The total reward of a completion is ``sum(weight * reward)``; each reward is also logged on its own as
``rollout/reward/<name>``. Any value that is NaN or infinite, a result of the wrong length, or an exception
raised inside a reward function stops the run with a one-line :class:`RewardError` that names the reward,
and for an exception also the file and line in the user's code and the first failing sample. An import path
that does not resolve fails when the module is built, before training.

Built-in rewards: :func:`sort_exact_match`, :func:`sort_format` and the graded :func:`sort_position_match` for the
bundled sort task
(:mod:`align.data.sort_task`), and :func:`math_answer` for GSM8K-style math answers. A trained reward model
is a reward too: :class:`RewardModelScorer` (defined in :mod:`align.models.reward`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
import sysconfig
import traceback
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Sequence

from align.data import sort_task
from align.data.prompts import REWARD_INPUTS
from align.errors import AlignConfigError, AlignError
from align.models.reward import RewardModelScorer

__all__ = [
    "RewardError",
    "RewardSpec",
    "RewardFunction",
    "CombinedReward",
    "RewardModelSpec",
    "LazyRewardModel",
    "training_rewards",
    "reward_inputs",
    "resolve_reward",
    "sort_exact_match",
    "sort_format",
    "sort_position_match",
    "math_answer",
    "extract_final_number",
    "RewardModelScorer",
    "error_location",
    "one_line",
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


def _load_file(path_text: str, attr: str, spec_text: str, what: str = "reward") -> Any:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise AlignConfigError(f"{what} '{spec_text}': file '{path}' does not exist (paths are relative to the "
                               f"working directory {Path.cwd()})")
    module_name = f"_align_{what.replace(' ', '_')}_{abs(hash(str(path.resolve())))}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - user code may raise anything on import
            raise AlignConfigError(f"{what} '{spec_text}': importing '{path}' failed: {type(err).__name__}: {err}") from err
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
    cwd = os.getcwd()
    if not any(os.path.realpath(p or os.curdir) == os.path.realpath(cwd) for p in sys.path):
        sys.path.append(cwd)


def _load_dotted(path: str, what: str = "reward") -> Any:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise AlignConfigError(f"{what} '{path}': expected an import path such as 'align.rewards.sort_exact_match' "
                               "or 'my_rewards.py:my_fn'")
    _cwd_importable()
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise AlignConfigError(f"{what} '{path}': cannot import module '{module_name}' ({err}; searched the "
                               f"installed packages and the working directory {os.getcwd()})") from err
    except Exception as err:  # noqa: BLE001 - user code may raise anything on import
        raise AlignConfigError(f"{what} '{path}': importing module '{module_name}' failed: "
                               f"{type(err).__name__}: {err}{error_location(err, None)}") from err
    if not hasattr(module, attr):
        raise AlignConfigError(f"{what} '{path}': module '{module_name}' has no attribute '{attr}'")
    return getattr(module, attr)


def resolve_import(fn: str | Any, what: str = "reward") -> Any:
    """The object named by an import path (``pkg.mod.name`` or ``file.py:name``); a non-string is returned as is.
    Errors name the path as ``<what> '<path>'``.

    A dotted path also finds modules in the working directory (``my_rewards.fn`` for ``./my_rewards.py``)."""
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


def _preview(text: Any, limit: int = 60) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------
# calling a reward: keyword arguments, filtered by its signature
# ----------------------------------------------------------------------------

BASE_INPUTS = ("prompts", "completions")
"""Keyword arguments every reward receives first; the rollout's own inputs (``REWARD_INPUTS``) and the data's
columns follow."""


def _target(fn: Any) -> Any:
    """The Python function whose code runs when ``fn`` is called: through partials, bound methods and ``__call__``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.isroutine(fn):
        return inspect.unwrap(getattr(fn, "__func__", fn))
    call = getattr(type(fn), "__call__", None)
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


_LIBRARY_DIRS = tuple({os.path.join(os.path.realpath(sysconfig.get_paths()[key]), "")
                       for key in ("stdlib", "platstdlib", "purelib", "platlib")}
                      | {os.path.join(os.path.realpath(Path(__file__).parent), "")})
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

    chosen = (next((f for f in reversed(frames) if is_user(f)), None)
              or next((f for f in reversed(frames) if own and os.path.realpath(f.filename) == own), None))
    if chosen is None:
        return ""
    # A comprehension has its own frame (``<listcomp>``): name the function it runs in.
    outer = frames[: frames.index(chosen) + 1]
    name = next((f.name for f in reversed(outer) if f.filename == chosen.filename and not f.name.startswith("<")), None)
    return f" at {_shown_path(chosen.filename)}, line {chosen.lineno}" + (f" in {name}()" if name else "")


class RewardFunction:
    """A resolved reward with its weight and metric name; calling it checks the result.

    The function is called with keyword arguments only (docs/rewards.md): ``prompts``, ``completions``, the
    rollout's inputs (``prompt_messages``, ``completion_ids``, ``completion_truncated``), every data column by
    name, and the spec's ``kwargs``. A function that takes ``**kwargs`` receives all of them, so both align's
    ``(prompts, completions, **columns)`` and TRL's ``(completions, **kwargs)`` work; one without receives only
    the names its signature lists. The signature is read once, here.
    """

    MAX_SINGLE_RETRIES = 64
    """After a batch call raises, at most this many samples are re-run one at a time to find the first failing one."""

    def __init__(self, spec: RewardSpec | str | RewardFn):
        if isinstance(spec, str):
            spec = RewardSpec(fn=spec)
        if isinstance(spec, RewardSpec):
            self.fn: RewardFn = resolve_reward(spec.fn)
            self.path = spec.fn if isinstance(spec.fn, str) else _qualname(self.fn)
            if isinstance(self.fn, type):
                try:
                    self.fn = self.fn(**(spec.init_kwargs or {}))
                except TypeError as err:
                    raise AlignConfigError(f"reward '{self.path}': cannot build it from init_kwargs "
                                           f"{spec.init_kwargs or {}}: {err}") from err
            elif spec.init_kwargs:
                raise AlignConfigError(f"reward '{self.path}': init_kwargs are for a class; pass per-call arguments "
                                       "in kwargs instead")
        elif callable(spec):
            self.fn, self.path = spec, _qualname(spec)
            spec = RewardSpec(fn=self.path)
        else:
            raise AlignConfigError(f"reward: expected an import path, a RewardSpec or a callable, got {spec!r}")
        self.weight = float(spec.weight)
        if not math.isfinite(self.weight):
            raise AlignConfigError(f"reward '{self.path}': weight must be finite, got {self.weight}")
        target = _target(self.fn)
        self.name = spec.name or (getattr(target, "__name__", None) if inspect.isroutine(self.fn)
                                  or isinstance(self.fn, functools.partial) else type(self.fn).__name__)
        self.kwargs = dict(spec.kwargs)
        self._read_signature()
        self._checked: tuple | None = None

    @property
    def where(self) -> str:
        """``reward '<name>' (<import path>[, <qualified name>])``: how every message names this reward."""
        qualname = _qualname(self.fn)
        shown = self.path if self.path.endswith(qualname) else f"{self.path}, {qualname}"
        return f"reward '{self.name}' ({shown})"

    def _read_signature(self) -> None:
        """Which keyword arguments the function accepts (``None``: any, it has ``**kwargs``) and which it requires."""
        try:
            params = list(inspect.signature(self.fn).parameters.values())
        except (TypeError, ValueError):  # some builtins and C callables have no signature: pass everything
            params = [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
        kinds = inspect.Parameter
        self.positional_only = [p.name for p in params if p.kind is kinds.POSITIONAL_ONLY]
        named = [p for p in params if p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)]
        self.accepts = None if any(p.kind is kinds.VAR_KEYWORD for p in params) else {p.name for p in named}
        self.required = {p.name for p in named if p.default is inspect.Parameter.empty}
        if self.accepts is not None:
            unknown = sorted(set(self.kwargs) - self.accepts)
            if unknown:
                raise AlignConfigError(f"{self.where}: kwargs {unknown} are not parameters of the function "
                                       f"(it takes {sorted(self.accepts)}; add **kwargs to take any)")
        clash = sorted(set(self.kwargs) & (set(BASE_INPUTS) | set(REWARD_INPUTS)))
        if clash:
            raise AlignConfigError(f"{self.where}: kwargs {clash} would replace inputs every reward receives; "
                                   "rename them")

    def check_inputs(self, columns: Sequence[str]) -> None:
        """Fail with one line when the function requires an argument that neither the rollout, the data columns
        ``columns`` nor the spec's kwargs provide, or a column clashes with an input; called before the first
        rollout of a run, when the data's column names are known."""
        key = tuple(columns)
        if self._checked == key:
            return
        available = [*BASE_INPUTS, *REWARD_INPUTS, *columns, *self.kwargs]
        clash = sorted(set(columns) & (set(BASE_INPUTS) | set(REWARD_INPUTS) | set(self.kwargs)))
        if clash:
            raise AlignConfigError(f"{self.where}: data column(s) {clash} have the name of a reward input or of this "
                                   "reward's kwargs; rename the column")
        missing = sorted(self.required - set(available))
        if missing:
            raise AlignConfigError(
                f"{self.where} requires {', '.join(repr(m) for m in missing)}, which no data "
                f"column or input provides (available: {', '.join(available)}; data columns: "
                f"{', '.join(columns) or 'none'})")
        self._checked = key

    def _call(self, inputs: dict[str, Any]) -> Any:
        inputs = {**inputs, **self.kwargs}
        if self.accepts is not None:
            inputs = {k: v for k, v in inputs.items() if k in self.accepts}
        args = [inputs.pop(name) for name in self.positional_only if name in inputs]
        return self.fn(*args, **inputs)

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float]:
        """The function's values for a batch, checked. ``columns`` holds the data's columns and the rollout's
        inputs (``REWARD_INPUTS``), one value per completion."""
        self.check_inputs([k for k in columns if k not in REWARD_INPUTS])
        inputs = {"prompts": prompts, "completions": completions, **columns}
        try:
            values = self._call(inputs)
        except RewardError:
            raise
        except Exception as err:  # noqa: BLE001 - user code; re-raised with context
            raise RewardError(self._describe_failure(err, inputs)) from err
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError) as err:
            bad = next((i for i, v in enumerate(values) if not _is_number(v)), None) if _is_iterable(values) else None
            sample = f" (sample {bad}: {_preview(values[bad])})" if bad is not None and bad < len(values) else ""
            raise RewardError(f"{self.where} must return a list of numbers, got {_preview(values)}{sample}") from err
        if len(values) != len(completions):
            raise RewardError(f"{self.where} returned {len(values)} values for {len(completions)} completions; "
                              "return one float per completion")
        for i, v in enumerate(values):
            if not math.isfinite(v):
                raise RewardError(f"{self.where} returned {v} for sample {i} (prompt {_preview(prompts[i])}, "
                                  f"completion {_preview(completions[i])}); rewards must be finite")
        return values

    def _describe_failure(self, err: Exception, inputs: dict[str, Any]) -> str:
        """One line: the reward, the exception and where the user's code raised it, and the first failing sample.

        The first failing sample is found by calling the function again on single samples, in order (at most
        :attr:`MAX_SINGLE_RETRIES`); a function that fails only on the whole batch is reported as such."""
        n = len(inputs["completions"])
        first = None
        for i in range(min(n, self.MAX_SINGLE_RETRIES)):
            single = {k: ([v[i]] if isinstance(v, (list, tuple)) and len(v) == n else v) for k, v in inputs.items()}
            try:
                self._call(single)
            except Exception:  # noqa: BLE001 - looking for the first sample that raises on its own
                first = i
                break
        message = (f"{self.where} raised {type(err).__name__}: {one_line(err)}"
                   f"{error_location(err, self.fn)}; ")
        if first is None:
            tried = "every sample" if n <= self.MAX_SINGLE_RETRIES else f"each of the first {self.MAX_SINGLE_RETRIES} samples"
            return message + f"{tried} passes on its own, the batch of {n} fails as a whole"
        columns = [f"{k}={_preview(v[first], 40)}" for k, v in inputs.items()
                   if k not in BASE_INPUTS and k not in REWARD_INPUTS and isinstance(v, (list, tuple)) and len(v) == n]
        return message + (f"first failing sample {first} of {n}: prompt {_preview(inputs['prompts'][first])}, "
                          f"completion {_preview(inputs['completions'][first])}"
                          + (f", {', '.join(columns)}" if columns else ""))


def one_line(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 200 else text[:197] + "..."


def _is_iterable(values: Any) -> bool:
    return isinstance(values, (list, tuple))


def _is_number(value: Any) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


class CombinedReward:
    """The weighted sum of several rewards, with each one's values kept for metrics."""

    def __init__(self, rewards: Sequence[RewardSpec | str | RewardFn], allow_empty: bool = False):
        """``allow_empty``: no reward functions at all is allowed (an environment rewards the episodes); the
        total is then 0 and there are no parts."""
        if not rewards and not allow_empty:
            raise AlignConfigError("rewards: give at least one reward function")
        self.rewards = [r if isinstance(r, RewardFunction) else RewardFunction(r) for r in rewards]
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise AlignConfigError(f"rewards: metric names must be unique, got {names}; set 'name' on duplicates")

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def check_inputs(self, columns: Sequence[str]) -> None:
        """Fail before any rollout when a reward requires an argument that the data columns ``columns`` and the
        rollout do not provide (:meth:`RewardFunction.check_inputs`)."""
        for reward in self.rewards:
            reward.check_inputs(columns)

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> tuple[list[float], dict[str, list[float]]]:
        """``(total, {name: values})``: the weighted total and each reward's own values, per completion."""
        parts = {r.name: r(prompts, completions, **columns) for r in self.rewards}
        total = [float(sum(r.weight * parts[r.name][i] for r in self.rewards)) for i in range(len(completions))]
        return total, parts


def reward_inputs(batch, rollout) -> dict[str, Any]:
    """The keyword arguments of every reward for ``rollout``, sampled from the prompts of ``batch`` (a
    :class:`~align.data.prompts.PromptBatch`): ``prompts``, ``completions``, the data's columns and the rollout's
    inputs (:data:`~align.data.prompts.REWARD_INPUTS`), one value per completion (a prompt's ``group_size``
    completions are consecutive).

    For a multi-turn rollout (``rollout.episodes``) a completion is the episode's last assistant turn
    (``completions``, ``completion_ids``), ``prompt_messages`` the episode's first messages (what the environment's
    ``reset`` gave), ``conversation`` every message of the episode, and ``completion_truncated`` whether the
    episode was cut off before the environment said done."""
    prompts, columns = batch.repeat(rollout.group_size)
    truncated = [bool(t) for t in rollout.truncated.tolist()]
    if rollout.episodes is not None:
        conversations = [e["messages"] for e in rollout.episodes]
        first = [e["messages"][: e["first_messages"]] for e in rollout.episodes]
        return {"prompts": prompts, "completions": rollout.texts, **columns, "prompt_messages": first,
                "completion_ids": [list(e["completion_ids"]) for e in rollout.episodes],
                "completion_truncated": truncated, "conversation": conversations}
    lengths = rollout.response_lengths.tolist()
    prompt_messages = batch.repeat_messages(rollout.group_size)
    return {"prompts": prompts, "completions": rollout.texts, **columns, "prompt_messages": prompt_messages,
            "completion_ids": [ids[:n] for ids, n in zip(rollout.response_ids.tolist(), lengths)],
            "completion_truncated": truncated,
            "conversation": [m + [{"role": "assistant", "content": t}] for m, t in zip(prompt_messages, rollout.texts)]}


@dataclass(frozen=True)
class RewardModelSpec:
    """A trained reward model used as the training reward named ``rm``."""

    path: str
    """An export directory (any ``*ForSequenceClassification`` checkpoint), a reward-model ``.ckpt``, or
    ``tiny-sort-rm``; loaded at setup, so a config instantiates without its weights."""
    weight: float = 1.0
    """Weight of the reward-model score in the training reward."""
    batch_size: int = 32
    """Sequences per reward-model forward pass."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise AlignConfigError(f"model.reward_model.batch_size: expected >= 1, got {self.batch_size}")


class LazyRewardModel:
    """A :class:`RewardModelScorer` built by :meth:`load` (at setup) or on first call, so that building a module
    from a config does not need the reward model's weights."""

    def __init__(self, path: str, batch_size: int = 32):
        self.path, self.batch_size = path, batch_size
        self.scorer: RewardModelScorer | None = None

    def load(self, device: str | None = None) -> RewardModelScorer:
        if self.scorer is None:
            self.scorer = RewardModelScorer(self.path, batch_size=self.batch_size, device=device)
        return self.scorer

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float]:
        inputs = {k: columns[k] for k in REWARD_INPUTS if k in columns}  # the data's own columns are not used
        return self.load()(prompts, completions, **inputs)


def training_rewards(rewards: Sequence[RewardSpec | str] | None, reward_model: RewardModelSpec | str | None,
                     eval_rewards: Sequence[RewardSpec | str] | None, environment: bool = False,
                     ) -> tuple[CombinedReward, list[str]]:
    """The reward list of an RL run and the names of its eval rewards.

    The reward model (the reward named ``rm``) comes first, then ``rewards``; ``eval_rewards`` join with weight
    0, so they are computed, checked and logged (``rollout/reward/<name>``, ``val/reward/<name>``) but never
    trained on, e.g. a task's true verifiable reward next to a reward model's score, so reward hacking shows.
    With ``environment`` (a multi-turn run, whose environment rewards the episodes) the list may be empty.
    """
    specs: list[RewardSpec | str | RewardFunction] = list(rewards or [])
    if isinstance(reward_model, str):
        reward_model = RewardModelSpec(reward_model)
    if reward_model is not None:
        rm = RewardFunction(LazyRewardModel(reward_model.path, reward_model.batch_size))
        rm.name, rm.weight = "rm", float(reward_model.weight)
        specs.insert(0, rm)
    if not specs and not environment:
        raise AlignConfigError("model.rewards: an RL run needs a training reward; set reward_model, rewards or "
                               "environment")
    evals = [RewardSpec(fn=s.fn, weight=0.0, name=s.name, kwargs=dict(s.kwargs), init_kwargs=s.init_kwargs)
             if isinstance(s, RewardSpec) else RewardSpec(fn=s, weight=0.0) for s in eval_rewards or []]
    combined = CombinedReward([*specs, *evals], allow_empty=environment)
    return combined, combined.names[len(specs):]


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


def sort_position_match(prompts: list[str], completions: list[str], answer: Sequence[str] | None = None,
                        **_: Any) -> list[float]:
    """Share of the sorted answer's positions that the completion gets right, over the longer of the two; 0.0 when
    the completion is not single letters separated by spaces. Graded, so two wrong completions can still be ranked
    (online DPO, where the binary exact match leaves most pairs tied). 1.0 exactly when ``sort_exact_match`` is 1.

    Uses the ``answer`` column when the data has one, else solves the prompt.
    """
    answers = list(answer) if answer is not None else [sort_task.solve(p) for p in prompts]
    out = []
    for completion, reference in zip(completions, answers):
        got, expected = sort_task.parse_answer(completion), reference.split()
        hits = sum(a == b for a, b in zip(got or [], expected))
        out.append(hits / max(len(got), len(expected)) if got else 0.0)
    return out


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

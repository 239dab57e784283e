"""One reward function: its entry in a config (:class:`RewardSpec`), its call with keyword arguments and the check of
what it returns (:class:`RewardFunction`), and the one-line :class:`RewardError` that names it when it fails.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from align.data.prompts import REWARD_INPUTS
from align.errors import INIT_KWARGS, AlignConfigError, AlignError, placed
from align.rollout.rewards.concurrent import Job, JobTimeout, evaluate, run_now
from align.rollout.rewards.inputs import BASE_INPUTS
from align.rollout.rewards.resolve import RewardFn, _qualname, _target, error_location, one_line, resolve_reward


class RewardError(AlignError):
    """A reward function failed: it raised, returned a non-finite value or a result of the wrong length."""


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
    concurrency: int = 1
    """Calls at once: the batch is cut into this many parts, called together (plain functions on threads, async
    functions awaited together); 1: one call on the whole batch."""
    timeout: float | None = None
    """Seconds a batch of this reward may take (all its parts); past it the run stops naming the reward. None: no
    limit."""


def _preview(text: Any, limit: int = 60) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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

    def __init__(self, spec: RewardSpec | str | RewardFn, setting: str | None = None):
        """``setting``: where the reward is in the config (``model.rewards[0]``), named by the errors of its settings;
        None (a reward built in Python, or on the command line) names the reward instead."""
        self.setting = setting
        if isinstance(spec, str):
            spec = RewardSpec(fn=spec)
        if isinstance(spec, RewardSpec):
            self.fn: RewardFn = resolve_reward(spec.fn)
            self.path = spec.fn if isinstance(spec.fn, str) else _qualname(self.fn)
            if isinstance(self.fn, type):
                try:
                    self.fn = self.fn(**(spec.init_kwargs or {}))
                except AlignConfigError as err:
                    raise self._placed(err) from None
                except TypeError as err:
                    raise AlignConfigError(
                        f"{self._key('init_kwargs')}: expected arguments {self.path} takes, got "
                        f"{spec.init_kwargs or {}} (TypeError: {err})"
                    ) from err
            elif spec.init_kwargs:
                raise AlignConfigError(
                    f"{self._key('init_kwargs')}: expected null for a function (init_kwargs build "
                    f"a class; pass per-call arguments in kwargs), got {spec.init_kwargs}"
                )
        elif callable(spec):
            self.fn, self.path = spec, _qualname(spec)
            spec = RewardSpec(fn=self.path)
        else:
            raise AlignConfigError(
                f"{setting or 'reward'}: expected an import path, a RewardSpec or a callable, got {spec!r}"
            )
        try:
            self.weight = float(spec.weight)
        except (TypeError, ValueError):
            self.weight = math.nan
        if not math.isfinite(self.weight):
            raise AlignConfigError(f"{self._key('weight')}: expected a finite number, got {spec.weight!r}")
        target = _target(self.fn)
        name = spec.name or (
            getattr(target, "__name__", None)
            if inspect.isroutine(self.fn) or isinstance(self.fn, functools.partial)
            else type(self.fn).__name__
        )
        assert name is not None  # _target of a routine or partial is a function (or __call__), which has a name
        self.name: str = name
        self.kwargs = dict(spec.kwargs)
        self.concurrency, self.timeout = spec.concurrency, spec.timeout
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise AlignConfigError(f"{self._key('concurrency')}: expected an integer >= 1, got {self.concurrency!r}")
        if self.timeout is not None and not (isinstance(self.timeout, (int, float)) and 0 < self.timeout < math.inf):
            raise AlignConfigError(
                f"{self._key('timeout')}: expected a number of seconds > 0 or null, got {self.timeout!r}"
            )
        self.is_async = inspect.iscoroutinefunction(target)
        """An ``async`` function (or ``async def __call__``): awaited on the reward loop, together with the others."""
        self._read_signature()
        check = getattr(self.fn, "check_kwargs", None)  # a reward's own check of its kwargs (math_verify's timeout)
        if callable(check):
            try:
                check(self.kwargs)
            except AlignConfigError as err:
                raise AlignConfigError(f"{self._key('kwargs')}.{err}") from None
        self._checked: tuple | None = None

    def _key(self, name: str) -> str:
        """How an error names this reward's setting ``name``: its path in the config (``model.rewards[0].timeout``),
        else the reward and the setting (``reward 'exact' (my_rewards.exact): timeout``)."""
        if self.setting:
            return f"{self.setting}.{name}"
        label = self.where if hasattr(self, "name") else f"reward '{self.path}'"
        return f"{label}: {name}"

    def _placed(self, err: AlignConfigError) -> AlignConfigError:
        """An error of the reward object's own settings (``init_kwargs.<setting>: ...``) under this reward's place."""
        if self.setting:
            return placed(err, self.setting)
        if str(err).startswith(f"{INIT_KWARGS}"):
            label = self.where if hasattr(self, "name") else f"reward '{self.path}'"
            return AlignConfigError(f"{label}: {err}")
        return err

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
                owner = self.where if self.setting else "the function"
                raise AlignConfigError(
                    f"{self._key('kwargs')}: expected parameters of {owner}, which takes "
                    f"{sorted(self.accepts)} (add **kwargs to take any), got {unknown}"
                )
        clash = sorted(set(self.kwargs) & (set(BASE_INPUTS) | set(REWARD_INPUTS)))
        if clash:
            raise AlignConfigError(
                f"{self._key('kwargs')}: expected names other than the inputs every reward "
                f"receives, got {clash}; rename them"
            )

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
            raise AlignConfigError(
                f"{self.where}: data column(s) {clash} have the name of a reward input or of this "
                "reward's kwargs; rename the column"
            )
        missing = sorted(self.required - set(available))
        if missing:
            raise AlignConfigError(
                f"{self.where} requires {', '.join(repr(m) for m in missing)}, which no data "
                f"column or input provides (available: {', '.join(available)}; data columns: "
                f"{', '.join(columns) or 'none'})"
            )
        check = getattr(self.fn, "check_columns", None)  # a reward object's own check (a judge's template fields)
        if callable(check):
            try:
                check(available)
            except AlignConfigError as err:
                raise (
                    placed(err, self.setting)
                    if self.setting and str(err).startswith(INIT_KWARGS)
                    else AlignConfigError(f"{self.where}: {err}")
                ) from None
        self._checked = key

    @property
    def counts_errors(self) -> bool:
        """Whether the reward object counts its failed calls (``take_errors()``, as :class:`align.rewards.Judge`
        and :class:`align.rewards.Remote` do): they are logged as ``rollout/reward_errors/<name>``."""
        return callable(getattr(self.fn, "take_errors", None))

    def take_errors(self) -> int:
        """Completions scored by default after a failed call since the last time asked (0 when not counted)."""
        # A reward object with its own take_errors() (counts_errors), which RewardFn's type does not show.
        return int(cast(Any, self.fn).take_errors()) if self.counts_errors else 0

    def _call(self, inputs: dict[str, Any]) -> Any:
        inputs = {**inputs, **self.kwargs}
        if self.accepts is not None:
            inputs = {k: v for k, v in inputs.items() if k in self.accepts}
        args = [inputs.pop(name) for name in self.positional_only if name in inputs]
        return self.fn(*args, **inputs)

    def bound(self, inputs: dict[str, Any]) -> Callable[[], Any]:
        """The call of the function on ``inputs`` (a coroutine's maker for an async function)."""
        return functools.partial(self._call, inputs)

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float | None]:
        """The function's values for a batch, checked (``None`` where it does not apply). ``columns`` holds the
        data's columns and the rollout's inputs (``REWARD_INPUTS``), one value per completion."""
        self.check_inputs([k for k in columns if k not in REWARD_INPUTS])
        return evaluate([self], {"prompts": prompts, "completions": completions, **columns})[self.name]

    def failure(self, err: BaseException, inputs: dict[str, Any], offset: int = 0, n: int | None = None) -> RewardError:
        """The :class:`RewardError` of a call on ``inputs`` (rows ``offset``... of a batch of ``n``) that raised
        ``err`` or ran past the timeout."""
        if isinstance(err, RewardError):
            return err
        rows = len(inputs["completions"])
        n = rows if n is None else n
        if isinstance(err, JobTimeout):
            part = f" (rows {offset}-{offset + rows - 1}, one of {self.concurrency} parts)" if rows < n else ""
            error = RewardError(
                f"{self.where} {err} on a batch of {n} completions{part}; raise the reward's timeout if it is only slow"
            )
        else:
            error = RewardError(self._describe_failure(err, inputs, offset, n))
        error.__cause__ = err
        return error

    def checked(self, values: Any, inputs: dict[str, Any], offset: int = 0) -> list[float | None]:
        """``values`` returned for ``inputs`` (rows ``offset``... of the batch) as floats (``None`` kept: the reward
        does not apply to that row), or a :class:`RewardError` naming the first bad value."""
        prompts, completions = inputs["prompts"], inputs["completions"]
        try:
            values = [None if v is None else float(v) for v in values]
        except (TypeError, ValueError) as err:
            bad = (
                next((i for i, v in enumerate(values) if v is not None and not _is_number(v)), None)
                if _is_iterable(values)
                else None
            )
            sample = (
                f" (sample {offset + bad}: {_preview(values[bad])})" if bad is not None and bad < len(values) else ""
            )
            raise RewardError(f"{self.where} must return a list of numbers, got {_preview(values)}{sample}") from err
        if len(values) != len(completions):
            raise RewardError(
                f"{self.where} returned {len(values)} values for {len(completions)} completions; "
                "return one float per completion"
            )
        for i, v in enumerate(values):
            if v is not None and not math.isfinite(v):
                raise RewardError(
                    f"{self.where} returned {v} for sample {offset + i} (prompt {_preview(prompts[i])}, "
                    f"completion {_preview(completions[i])}); rewards must be finite"
                )
        return values

    def _describe_failure(
        self, err: BaseException, inputs: dict[str, Any], offset: int = 0, total: int | None = None
    ) -> str:
        """One line: the reward, the exception and where the user's code raised it, and the first failing sample.

        The first failing sample is found by calling the function again on single samples, in order (at most
        :attr:`MAX_SINGLE_RETRIES`); a function that fails only on the whole batch is reported as such."""
        n = len(inputs["completions"])
        total = n if total is None else total
        first = None
        for i in range(min(n, self.MAX_SINGLE_RETRIES)):
            single = {k: ([v[i]] if isinstance(v, (list, tuple)) and len(v) == n else v) for k, v in inputs.items()}
            try:
                run_now(Job(self.bound(single), self.is_async, self.timeout))
            except Exception:  # noqa: BLE001 - looking for the first sample that raises on its own
                first = i
                break
        message = f"{self.where} raised {type(err).__name__}: {one_line(err)}{error_location(err, self.fn)}; "
        if first is None:
            tried = (
                "every sample"
                if n <= self.MAX_SINGLE_RETRIES
                else f"each of the first {self.MAX_SINGLE_RETRIES} samples"
            )
            return message + f"{tried} passes on its own, the batch of {n} fails as a whole"
        columns = [
            f"{k}={_preview(v[first], 40)}"
            for k, v in inputs.items()
            if k not in BASE_INPUTS and k not in REWARD_INPUTS and isinstance(v, (list, tuple)) and len(v) == n
        ]
        return message + (
            f"first failing sample {offset + first} of {total}: "
            f"prompt {_preview(inputs['prompts'][first])}, "
            f"completion {_preview(inputs['completions'][first])}" + (f", {', '.join(columns)}" if columns else "")
        )


def _is_iterable(values: Any) -> bool:
    return isinstance(values, (list, tuple))


def _is_number(value: Any) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False

"""``math_verify``: a math answer checked by the math-verify library (``pip install 'align[rewards]'``).

The gold answer comes from a data column (``answer`` by default): a bare number, LaTeX (``\\frac{3}{4}``,
``$\\sqrt{2}$``), or a GSM8K solution ending in ``#### <number>`` (the text after the last ``####`` is the gold). A
reply is read the same way, from the text after its last ``####`` when it has one: math-verify takes its boxed
answer first, else one after "the answer is", else its last expression. math-verify then compares them symbolically,
so ``0.75`` equals ``3/4`` and ``\\boxed{\\frac34}``, and ``1,000`` equals ``1000``.

One departure from math-verify's own equality: a reply whose answer is arithmetic on numbers left to compute
(``4 * 7 + 8``, ``\\frac12 + \\frac13``, ``10^3``) scores 0 even when its value is right (``require_computed``).
math-verify evaluates such an expression, so restating the question would earn the point, a shortcut a policy under
RL can find: on the bundled arithmetic task, 112 of 1,224 replies sampled from SmolLM2-135M-Instruct would have
earned a point that way. A number, a fraction ``p/q``, a decimal or a percentage, and any irrational or symbolic form
(``2\\sqrt{2}``, ``\\pi/2``, ``x^2+1``) count as they are.

math-verify bounds each parse and comparison with ``signal.alarm``, which works on the main thread only. On the main
thread (a reward that runs in the calling thread, :mod:`align.rollout.rewards.concurrent`) each check gets
``timeout`` seconds; on any other thread the checks run without that bound, and the reward's own ``timeout``
(``RewardSpec.timeout``) bounds the whole batch instead.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

from align.data.prompts import REWARD_INPUTS
from align.errors import AlignConfigError
from align.rollout.rewards.service import REWARDS_EXTRA

log = logging.getLogger(__name__)

_warned_off_main = False


def _library():
    try:
        from math_verify import parse, verify
    except ImportError:
        raise AlignConfigError(
            f"align.rewards.math_verify needs the math-verify package; install it with: {REWARDS_EXTRA}"
        ) from None
    return parse, verify


def answer_text(text: Any) -> str:
    """The part of a gold answer or a reply that holds the answer: the text after the last ``####`` (GSM8K's
    marker) when there is one, else the whole text, stripped."""
    text = str(text)
    return (text.rsplit("####", 1)[1] if "####" in text else text).strip()


def check_timeout(seconds: float) -> int | None:
    """math-verify's timeout for this thread: ``seconds`` rounded up to whole seconds (``signal.alarm``'s unit) on
    the main thread; None (no alarm) on any other thread, with a warning the first time."""
    global _warned_off_main
    if threading.current_thread() is threading.main_thread():
        return max(1, math.ceil(seconds))
    if not _warned_off_main:
        _warned_off_main = True
        log.warning(
            "align.rewards.math_verify runs off the main thread (a reward with concurrency or a timeout, or "
            "a second plain reward), where math-verify's per-check timeouts cannot work: its checks run "
            "unbounded; set the reward's timeout to bound a batch"
        )
    return None


def parse_gold(text: Any, timeout: int | None = None) -> list:
    """math-verify's parse of a gold answer (:func:`answer_text` of it); LaTeX commands without ``$`` delimiters
    (``\\sqrt{2}/2``) are read as math. Raises ValueError when nothing in it parses: a gold answer must hold one."""
    parse, _ = _library()
    body = answer_text(text)
    parsed = parse(body, parsing_timeout=timeout)
    if not parsed and "\\" in body and "$" not in body:  # LaTeX commands without delimiters
        parsed = parse(f"${body}$", parsing_timeout=timeout)
    if not parsed:
        raise ValueError(f"the gold answer {str(text)[-80:]!r} holds no number or expression math-verify can parse")
    return parsed


def is_computed(answer: Any) -> bool:
    """False for a parsed answer that is arithmetic on numbers left to compute (``4*7 + 8``, ``1/2 + 1/3``,
    ``10**3``, ``8*7 + 6.``); True for a number, a fraction ``p/q`` (``-p/q``), a percentage, an irrational or
    symbolic value (``2*sqrt(2)``, ``pi/2``, ``x**2 + 1``), a set or an interval."""
    import sympy

    if not isinstance(answer, sympy.Expr) or isinstance(answer, sympy.Number):
        return True
    leaves = answer.atoms()
    if not all(isinstance(leaf, sympy.Number) for leaf in leaves):  # a symbol or a constant such as pi
        return True
    if not any(isinstance(leaf, sympy.Float) for leaf in leaves) and answer.is_rational is not True:
        return True  # irrational (2*sqrt(2)), or sympy cannot tell: a form of its own
    factors = answer.args if isinstance(answer, sympy.Mul) else (answer,)
    if any(isinstance(f, sympy.UnevaluatedExpr) and f.args[0] == sympy.Rational(1, 100) for f in factors):
        return len(factors) == 2 and any(isinstance(f, sympy.Number) for f in factors)  # a percentage: 3.5%
    inverse = [f for f in factors if isinstance(f, sympy.Pow) and isinstance(f.base, sympy.Integer) and f.exp == -1]
    whole = [f for f in factors if isinstance(f, sympy.Integer)]
    return len(inverse) == 1 and len(inverse) + len(whole) == len(factors) and sum(w != -1 for w in whole) <= 1


def math_verify(
    prompts: list[str],
    completions: list[str],
    gold_column: str = "answer",
    timeout: float = 5.0,
    require_computed: bool = True,
    **columns: Any,
) -> list[float]:
    """1.0 when math-verify finds the completion's answer equal to the gold answer of column ``gold_column``, else
    0.0 (also for a reply with nothing to parse).

    ``timeout``: seconds for each parse and comparison when run on the main thread (rounded up to whole seconds;
    math-verify uses ``signal.alarm``). ``require_computed``: a reply whose answer is arithmetic left to compute
    scores 0 (:func:`is_computed`); false compares it by value. A gold answer that does not parse stops the run
    naming the sample: it is a data error, not a wrong reply.
    """
    if gold_column not in columns:
        data = sorted(k for k in columns if k not in REWARD_INPUTS)
        raise ValueError(
            f"math_verify reads the gold answer from the column {gold_column!r}, which the prompt data "
            f"does not have (its columns: {data or 'none'}); set kwargs.gold_column"
        )
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"math_verify: timeout must be > 0 seconds, got {timeout!r}")
    parse, verify = _library()
    seconds = check_timeout(timeout)
    golds: dict[str, list] = {}
    out = []
    with _outer_alarm_kept(seconds is not None):
        for completion, gold in zip(completions, _as_list(columns[gold_column])):
            key = str(gold)
            if key not in golds:
                golds[key] = parse_gold(key, seconds)
            reply = parse(answer_text(completion), parsing_timeout=seconds)
            right = (
                bool(reply)
                and (not require_computed or is_computed(reply[0]))
                and verify(golds[key], reply, timeout_seconds=seconds)
            )
            out.append(1.0 if right else 0.0)
    return out


@contextmanager
def _outer_alarm_kept(on: bool):
    """Around math-verify's alarms (``on``): a timer that was already set (``SIGALRM``, e.g. pytest-timeout's) is
    cancelled by them; it is set again afterwards for the time it had left (its handler math-verify restores)."""
    left, start = (signal.getitimer(signal.ITIMER_REAL)[0], time.monotonic()) if on else (0.0, 0.0)
    try:
        yield
    finally:
        if left > 0:
            signal.setitimer(signal.ITIMER_REAL, max(left - (time.monotonic() - start), 1e-3))


def _check_installed(available: list[str]) -> None:
    """Before the first rollout: math-verify must be installed (the check hook of :class:`RewardFunction`)."""
    _library()


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    """When the reward is built (the kwargs hook of :class:`RewardFunction`): its settings, named as its kwargs."""
    timeout = kwargs.get("timeout", 5.0)
    if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0 and math.isfinite(timeout)):
        raise AlignConfigError(f"timeout: expected a number of seconds > 0, got {timeout!r}")
    gold_column = kwargs.get("gold_column", "answer")
    if not (isinstance(gold_column, str) and gold_column):
        raise AlignConfigError(f"gold_column: expected the name of a data column, got {gold_column!r}")


math_verify.check_columns = _check_installed  # type: ignore[attr-defined]  # a hook RewardFunction looks up
math_verify.check_kwargs = _check_kwargs  # type: ignore[attr-defined]  # a hook RewardFunction looks up


def _as_list(values: Sequence[Any] | Any) -> list:
    return list(values) if isinstance(values, (list, tuple)) else [values]

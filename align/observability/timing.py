"""``Timer``: how the RL modules time a step's sections, and the spans of those sections.

``with Timer(timings, "time/generation_s"):`` adds the block's wall-clock seconds to ``timings[...]`` (logged as a
metric). While an ``OTelTracingCallback`` runs in this process, the block is also a span named after the key
(``time/generation_s`` -> ``generation``) under the span open in the same thread, else under the trainer's current
step span. Without the callback a span costs one global read, and importing this module does not import
opentelemetry.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Protocol


class _Tracing(Protocol):
    def open_span(self, name: str) -> Any: ...  # an entered context manager, or None

    def annotate(self, attributes: dict[str, Any]) -> None: ...  # on the span current in this thread

    def record_span(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any]) -> None: ...


_active: _Tracing | None = None  # set by ``OTelTracingCallback.setup``, cleared by its ``teardown``


def span_name(key: str) -> str:
    """``time/generation_s`` -> ``generation``: the metric key without its group and unit."""
    name = key.rpartition("/")[2]
    return name[:-2] if name.endswith("_s") else name


class Timer:
    """Wall-clock seconds of a block, added to ``store[name]``; a span of the block while tracing is active."""

    __slots__ = ("store", "name", "start", "span")

    def __init__(self, store: dict[str, float], name: str):
        self.store, self.name = store, name

    def __enter__(self) -> Timer:
        tracing = _active
        self.span = tracing.open_span(span_name(self.name)) if tracing is not None else None
        self.start = time.perf_counter()
        return self

    def annotate(self, attributes: dict[str, Any]) -> None:
        """Set attributes on the block's span (nothing without tracing)."""
        if self.span is not None and _active is not None:
            _active.annotate(attributes)

    def __exit__(self, *exc: Any) -> Literal[False]:
        self.store[self.name] = self.store.get(self.name, 0.0) + time.perf_counter() - self.start
        if self.span is not None:
            self.span.__exit__(*exc)  # records an exception on the span, with an error status
        return False


def record_span(name: str, start_ns: int, end_ns: int, attributes: dict[str, Any]) -> None:
    """A finished span of work timed elsewhere (another thread; ``time.time_ns()`` bounds) under the span open in
    this thread: the multi-turn rollout's environment calls under its ``generation`` span. Nothing without tracing."""
    if _active is not None:
        _active.record_span(name, start_ns, end_ns, attributes)


def _install(tracing: _Tracing | None) -> None:
    global _active
    _active = tracing

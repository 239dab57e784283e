"""The span and distribution API that modules call. Importing this never imports opentelemetry.

When no ``OTelTracingCallback`` is active, ``span`` returns a shared no-op context manager (a global read and a
function call, nothing more), so modules can call it unconditionally::

    from align.observability import span, annotate, record_distribution

    def training_step(self, batch, batch_idx):
        with span("generation", prompts=len(batch)) as s:
            rollout = self.rollout_engine.generate(batch)
            s.set_attribute("completion_tokens", int(rollout.response_mask.sum()))
        with span("scoring"):
            rewards = self.reward(rollout)
        with span("reference_forward"):
            ...
        for epoch in range(self.update_epochs):
            with span("update_epoch", epoch=epoch):
                ...
        annotate(reward_mean=float(rewards.mean()))          # attributes on the current step span
        record_distribution(self, "rollout/reward", rewards)  # a histogram in every OTLPLogger of the trainer

Spans opened with ``span`` nest under the span open in the same thread (``with span(...)`` inside another), and
otherwise under the trainer's current ``step`` span (or ``epoch``/``fit``/``validation`` outside a step), so a
module needs no handle on the callback. Attribute values must be str, bool, int, float or lists of one of those;
other values are converted with ``str``. Spans that raise record the exception and end with an error status.
Recommended names, so dashboards agree across algorithms: ``generation``, ``scoring``, ``reward``,
``reference_forward``, ``value_forward``, ``advantages``, ``update_epoch``, ``optimizer_step``.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol


class _Span(Protocol):
    def set_attribute(self, key: str, value: Any) -> None: ...
    def set_attributes(self, attributes: dict[str, Any]) -> None: ...
    def add_event(self, name: str, attributes: dict[str, Any] | None = None) -> None: ...


class _NoOpSpan:
    """What ``with span(...) as s`` yields when tracing is off: every method does nothing."""

    __slots__ = ()

    def __enter__(self) -> "_NoOpSpan":
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        pass

    def add_event(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        pass

    def record_exception(self, exception: BaseException, attributes: dict[str, Any] | None = None) -> None:
        pass

    def is_recording(self) -> bool:
        return False


NOOP_SPAN = _NoOpSpan()


class _Backend(Protocol):
    def child_span(self, name: str, attributes: dict[str, Any]) -> Any: ...
    def annotate(self, attributes: dict[str, Any]) -> None: ...


_backend: _Backend | None = None


def span(name: str, **attributes: Any):
    """A context manager timing ``name`` as a child of the current span; a no-op when tracing is off."""
    backend = _backend
    if backend is None:
        return NOOP_SPAN
    return backend.child_span(name, attributes)


def annotate(**attributes: Any) -> None:
    """Set attributes on the innermost open span of this thread (else the trainer's current step span)."""
    backend = _backend
    if backend is not None:
        backend.annotate(attributes)


def tracing_enabled() -> bool:
    """True while an ``OTelTracingCallback`` is active in this process."""
    return _backend is not None


def record_distribution(owner: Any, name: str, values: Iterable[float] | Any) -> None:
    """Record every value of a distribution (rewards, response lengths) in each OTLP logger of ``owner``.

    ``owner`` is a LightningModule, a Trainer, or a logger. ``values`` is a sequence of numbers or a tensor (of any
    shape; it is flattened). Exported as an OTLP histogram named by the logger's scheme (``rollout/reward`` ->
    ``align.rollout.reward``). Without an OTLP logger this returns before touching ``values``, so a tensor is not
    copied to the CPU for nothing.
    """
    targets = [lg for lg in _loggers_of(owner) if hasattr(lg, "record_distribution")]
    for logger in targets:
        logger.record_distribution(name, values)


def _loggers_of(owner: Any) -> list:
    if owner is None:
        return []
    if hasattr(owner, "record_distribution") and not hasattr(owner, "loggers"):
        return [owner]
    trainer = owner if hasattr(owner, "loggers") and hasattr(owner, "strategy") else getattr(owner, "_trainer", None)
    if trainer is None:
        return []
    return list(getattr(trainer, "loggers", None) or [])


def _install(backend: _Backend | None) -> None:
    global _backend
    _backend = backend


def _current() -> _Backend | None:
    return _backend

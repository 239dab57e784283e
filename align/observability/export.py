"""The OTLP export pipeline shared by ``OTLPLogger`` (metrics) and ``OTelTracingCallback`` (traces); what each
export is told is :class:`~align.observability.settings.ExportSettings`.

Failure isolation: every export goes through a counting wrapper that never raises, counts what was delivered and
dropped, and warns once per run and collector. The final flush of a stage runs on a daemon thread and the training
thread waits at most ``timeout`` seconds for it, at most ``FAILING_WAIT`` (one second) once the collector is known to
fail, and no longer once the flush's own export is refused. A flush that runs out of time marks the collector failing.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from align.observability.settings import ExportSettings

SCOPE = "align.observability"  # the logger and the instrumentation scope of align's own telemetry
log = logging.getLogger(SCOPE)

FAILING_WAIT = 1.0  # the most a final flush waits once the collector is known to fail (docs/observability.md)

# Collector address -> failures (of any signal: failed exports, SDK retry messages) since its last successful export.
_failures: collections.Counter[str] = collections.Counter()


class _SdkLogCapture(logging.Filter):
    """While align exporters are active, the SDK's per-attempt export errors are not printed (one warning from
    ``DropCounter`` replaces them); the latest is kept as the reason. A message naming a collector marks it failing
    at once, so that a final flush stops waiting at the SDK's first retry instead of through its backoff."""

    def __init__(self):
        super().__init__()
        self.users = 0
        self.recent: collections.deque[str] = collections.deque(maxlen=32)
        self.addresses: set[str] = set()
        self.lock = threading.Lock()
        self.loggers: list[logging.Logger] = []
        self.levels: dict[logging.Logger, int] = {}  # levels this filter lowered to WARNING, to restore

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        try:
            message = record.getMessage()
        except Exception:
            return False
        self.recent.append(message)
        for address in list(self.addresses):
            if _names(message, address):
                _failures[address] += 1
        return False

    def reason_for(self, address: str) -> str | None:
        """The latest suppressed SDK message that names this collector address."""
        return next((m for m in reversed(list(self.recent)) if _names(m, address)), None)

    def acquire(self, address: str) -> None:
        with self.lock:
            self.users += 1
            self.addresses.add(address)
            # Rescanned each time: exporter modules imported since (e.g. HTTP after gRPC) have their own loggers.
            names = [
                n
                for n in list(logging.root.manager.loggerDict)
                if n.startswith(("opentelemetry.exporter", "opentelemetry.sdk"))
            ]
            for lg in (logging.getLogger(n) for n in names):
                if lg not in self.loggers:
                    # First, before the SDK's own DuplicateFilter, which would hide repeated retry messages from it.
                    lg.filters.insert(0, self)
                    self.loggers.append(lg)
            for lg in self.loggers:
                if lg.getEffectiveLevel() > logging.WARNING:
                    # A filter only sees records the logger creates: with warnings switched off (a root level of
                    # ERROR, ALIGN_LOG_LEVEL=ERROR) the SDK's retry message would never mark the collector failing,
                    # and a flush to a refusing collector would sit through the whole backoff. This filter drops
                    # every WARNING+ record, so nothing more is printed.
                    self.levels.setdefault(lg, lg.level)
                    lg.setLevel(logging.WARNING)

    def release(self, grace: float = 0.0) -> None:
        """Drop one user; the filter stays ``grace`` seconds longer for exports abandoned at shutdown."""
        with self.lock:
            self.users = max(0, self.users - 1)
        if grace > 0:
            timer = threading.Timer(grace, self._remove_if_unused)
            timer.daemon = True
            timer.start()
        else:
            self._remove_if_unused()

    def _remove_if_unused(self) -> None:
        with self.lock:
            if self.users == 0:
                for lg in self.loggers:
                    lg.removeFilter(self)
                for lg, level in self.levels.items():
                    lg.setLevel(level)
                self.loggers, self.addresses, self.levels = [], set(), {}


def _names(message: str, address: str) -> bool:
    """Whether an SDK message is about this collector (gRPC names ``host:port``, requests ``port=N)``)."""
    return address in message or f"port={address.rpartition(':')[2]})" in message


SDK_LOGS = _SdkLogCapture()
SHUTDOWN_TIMEOUT = "the collector did not answer before the shutdown timeout"
_CAUSES = (
    ("connection refused", "the connection was refused: nothing listens at {address}"),
    ("name or service not known", "the collector's host name does not resolve"),
    ("nodename nor servname", "the collector's host name does not resolve"),
    ("name resolution", "the collector's host name does not resolve"),
    ("deadline_exceeded", "the collector did not answer in time"),
    ("timed out", "the collector did not answer in time"),
    ("certificate", "the TLS handshake failed (certificate)"),
    ("unauthenticated", "the collector refused the credentials"),
    ("unauthorized", "the collector refused the credentials"),
    ("permission_denied", "the collector refused the credentials"),
    ("forbidden", "the collector refused the credentials"),
)


def condensed(message: str, address: str) -> str:
    """What an SDK export message says went wrong, in a few words (a refused connection, an unknown host, a timeout,
    refused credentials), else its first line, shortened."""
    lowered = message.lower()
    for needle, cause in _CAUSES:
        if needle in lowered:
            return cause.format(address=address)
    first = (message.strip().splitlines() or [""])[0]
    return first if len(first) <= 200 else first[:197] + "..."


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


class DropCounter:
    """Counts what one logger's or callback's exports dropped over its whole life, keeps whether its collector is
    failing (``_failures``), and warns once per (run, collector) for the whole process."""

    def __init__(self, settings: ExportSettings):
        self.settings, self.run_id = settings, ""
        self.failed = 0
        self.dropped_in_queue = 0
        self.lock = threading.Lock()

    @property
    def dropped(self) -> int:
        return self.failed + self.dropped_in_queue

    def ok(self) -> None:
        _failures.pop(self.settings.address, None)

    def fail(self, n: int, reason: str | None = None, fallback: str = "no answer from the collector") -> None:
        """Count ``n`` dropped items. The warning's reason: ``reason`` (an exception), else what the SDK said about
        this collector (a refused connection, an unknown host), else ``fallback``."""
        with self.lock:
            self.failed += n
        _failures[self.settings.address] += 1
        said = SDK_LOGS.reason_for(self.settings.address)
        self.warn_once(reason or (condensed(said, self.settings.address) if said else fallback))

    def queue_overflow(self, n: int = 1) -> None:
        with self.lock:
            self.dropped_in_queue += n
        self.warn_once("the export queue is full (the collector is slower than the training loop)")

    def warn_once(self, reason: str | None) -> None:
        key = (self.run_id, self.settings.address)
        with _warned_lock:
            if key in _warned:
                return
            _warned.add(key)
        log.warning(
            "OTLP export of %s to %s is failing (%s); training continues and telemetry of this run is dropped "
            "while it fails. This is reported once; the dropped counts are on the logger's and callback's "
            "`dropped` attribute.",
            self.settings.signal,
            self.settings.describe(),
            reason or "no reason given",
        )


def _count(data: Any) -> int:
    """Data points in ``MetricsData``, spans in a span batch."""
    if not isinstance(data, MetricsData):
        return len(data)
    return sum(len(m.data.data_points) for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics)


class CountingExporter(MetricExporter, SpanExporter):
    """Wraps an SDK metric or span exporter: counts what was dropped, never raises, and lets the bounded shutdown
    abandon a request still in flight."""

    def __init__(self, inner: MetricExporter | SpanExporter, counter: DropCounter):
        MetricExporter.__init__(
            self,
            preferred_temporality=getattr(inner, "_preferred_temporality", None),
            preferred_aggregation=getattr(inner, "_preferred_aggregation", None),
        )
        self.inner, self.counter = inner, counter
        self.failure = MetricExportResult.FAILURE if isinstance(inner, MetricExporter) else SpanExportResult.FAILURE
        self.seen = 0  # items handed to ``export``, delivered or not
        self.in_flight = 0
        self.abandoned = False

    # One wrapper for both SDK interfaces, whose ``export`` signatures (argument names and types) differ: ``data`` is
    # MetricsData or a span batch, and the result that of the inner exporter.
    def export(self, data: Any, **kwargs: Any) -> Any:  # type: ignore[override]  # both interfaces' export
        n = _count(data)
        self.seen += n
        failure = self.failure
        if self.abandoned:
            self.counter.fail(n, fallback=SHUTDOWN_TIMEOUT)
            return failure
        self.in_flight = n
        try:
            result, reason = self.inner.export(data, **kwargs), None
        except Exception as err:  # an exporter bug must not reach the SDK's worker thread
            result, reason = failure, repr(err)
        self.in_flight = 0
        if not self.abandoned:  # once abandoned, ``abandon`` has counted this batch
            (self.counter.ok() if result.name == "SUCCESS" else self.counter.fail(n, reason))
        return result

    def abandon(self) -> None:
        """Shutdown ran out of time: count the batch still in flight as dropped and stop the exporter (which also
        ends the SDK's retry backoff)."""
        self.abandoned = True
        if self.in_flight:
            self.counter.fail(self.in_flight, fallback=SHUTDOWN_TIMEOUT)
        self.inner.shutdown()

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis)  # type: ignore[arg-type]  # SpanExporter's stub says int ms

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        self.inner.shutdown(*args, **kwargs)


class CountingSpanProcessor(SpanProcessor):
    """In front of a ``BatchSpanProcessor``: spans ended minus spans handed to the exporter, beyond the queue's
    capacity, were dropped by the bounded queue; that is detected on the training thread in O(1)."""

    def __init__(self, inner: SpanProcessor, exporter: CountingExporter, max_queue_size: int):
        self.inner, self.exporter, self.max_queue_size = inner, exporter, max_queue_size
        self.ended = self.dropped = 0  # this stage's; the exporter's counter keeps the whole life's

    def on_start(self, span, parent_context=None) -> None:
        self.inner.on_start(span, parent_context=parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        self.ended += 1
        backlog = self.ended - self.exporter.seen - self.dropped
        if backlog > self.max_queue_size:
            self.dropped += backlog - self.max_queue_size
            self.exporter.counter.queue_overflow(backlog - self.max_queue_size)
        self.inner.on_end(span)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.inner.force_flush(timeout_millis)


class ExportPipeline:
    """One signal's export for a logger or a callback: a ``CountingExporter`` per stage around the SDK exporter,
    one ``DropCounter`` for the owner's whole life, and the bounded final flush.

    ``start`` returns the exporter for the SDK's reader or span processor; ``close`` runs the provider's shutdown
    (which flushes) on a daemon thread and returns when it is done, at a new failure of the collector (a failed
    export, or the SDK's retry message), after ``FAILING_WAIT`` seconds if the collector was failing already, or
    after ``timeout`` seconds, whichever comes first.
    """

    def __init__(self, settings: ExportSettings):
        self.settings = settings
        self.counter = DropCounter(settings)
        self.exporter: CountingExporter | None = None

    @property
    def dropped(self) -> int:
        return self.counter.dropped

    def start(self, run_id: str) -> CountingExporter:
        self.counter.run_id = run_id
        self.exporter = CountingExporter(self.settings.exporter(), self.counter)
        SDK_LOGS.acquire(self.settings.address)
        return self.exporter

    def close(self, shutdown: Callable[[], Any]) -> bool:
        """Run ``shutdown`` (the provider's) with the bounded wait; True when it finished in time."""
        exporter, self.exporter = self.exporter, None
        if exporter is None:
            return True
        done = threading.Event()

        def run():
            try:
                shutdown()
            except Exception as err:  # a failing flush must not fail training
                log.debug("OTLP shutdown raised %r", err)
            finally:
                done.set()

        def failures() -> int:
            return _failures[self.settings.address]

        before = failures()  # read before the flush starts: a refusal can come before the thread below returns
        threading.Thread(target=run, name="align-otlp-shutdown", daemon=True).start()
        finished = _wait(done, self.settings.timeout, failures, before)
        if not finished:  # no answer in time, whatever the flush was doing: later flushes wait FAILING_WAIT at most
            _failures[self.settings.address] += 1
        if not finished or (exporter.in_flight and not exporter.abandoned):  # the SDK returned with a request pending
            try:
                exporter.abandon()
            except Exception as err:
                log.debug("OTLP exporter shutdown raised %r", err)
        SDK_LOGS.release(grace=self.settings.timeout + 1.0)
        return finished


def _wait(done: threading.Event, timeout: float, failures: Callable[[], int], before: int) -> bool:
    """Wait for ``done`` at most ``timeout`` seconds, at most ``FAILING_WAIT`` when the collector was failing
    already (``before`` failures), and no longer once a new failure shows (the SDK then only backs off and
    retries)."""
    deadline = time.monotonic() + (min(timeout, FAILING_WAIT) if before else timeout)
    while not done.wait(0.05):
        if time.monotonic() >= deadline or failures() > before:
            return done.is_set()
    return True

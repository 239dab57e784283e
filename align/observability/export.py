"""OTLP exporter settings (constructor arguments first, then the standard ``OTEL_*`` environment variables), the
resource that identifies a run's rank, and the bookkeeping that keeps a failing collector from hurting training:
drop counting, a single warning, and shutdowns bounded by the configured timeout.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence
from urllib.parse import unquote, urlparse

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from align.errors import AlignError

log = logging.getLogger("align.observability")

Protocol_ = Literal["grpc", "http/protobuf"]
Signal = Literal["metrics", "traces"]
DEFAULT_PORTS = {"grpc": 4317, "http/protobuf": 4318}
RUN_ID_ENV = "ALIGN_RUN_ID"


class ObservabilityConfigError(AlignError, ValueError):
    """A bad OTLP setting (protocol, compression, headers, timeout)."""


def _env(signal: Signal, name: str) -> str | None:
    """``OTEL_EXPORTER_OTLP_<SIGNAL>_<NAME>``, then ``OTEL_EXPORTER_OTLP_<NAME>``."""
    value = os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_{name}")
    return value if value not in (None, "") else (os.environ.get(f"OTEL_EXPORTER_OTLP_{name}") or None)


def parse_headers(headers: Mapping[str, str] | str | None) -> dict[str, str]:
    """``{"k": "v"}`` or the W3C-baggage-style ``k1=v1,k2=v2`` (URL-encoded values) used by ``OTEL_*_HEADERS``."""
    if headers is None:
        return {}
    if isinstance(headers, Mapping):
        return {str(k).strip().lower(): str(v) for k, v in headers.items()}
    out = {}
    for item in str(headers).split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ObservabilityConfigError(
                f"OTLP headers: expected 'key=value' pairs separated by commas, got {item!r}")
        out[unquote(key.strip()).lower()] = unquote(value.strip())
    return out


@dataclass(frozen=True)
class ExportSettings:
    """Where and how one signal is exported; build with ``ExportSettings.resolve``."""

    signal: Signal
    protocol: Protocol_
    endpoint: str  # grpc: "host:port"; http: the full URL of the signal's path
    insecure: bool
    headers: dict[str, str] = field(default_factory=dict)
    compression: Literal["none", "gzip", "deflate"] = "none"
    timeout: float = 10.0  # seconds, per export and for shutdown
    certificate_file: str | None = None
    client_key_file: str | None = None
    client_certificate_file: str | None = None

    @staticmethod
    def resolve(
        signal: Signal,
        *,
        endpoint: str | None = None,
        protocol: str | None = None,
        headers: Mapping[str, str] | str | None = None,
        insecure: bool | None = None,
        compression: str | None = None,
        timeout: float | None = None,
        certificate_file: str | None = None,
        client_key_file: str | None = None,
        client_certificate_file: str | None = None,
    ) -> "ExportSettings":
        proto = (protocol or _env(signal, "PROTOCOL") or "grpc").strip().lower()
        proto = {"http": "http/protobuf", "http/proto": "http/protobuf"}.get(proto, proto)
        if proto not in DEFAULT_PORTS:
            raise ObservabilityConfigError(f"OTLP protocol: expected 'grpc' or 'http/protobuf', got {protocol!r}")

        # A signal-specific env endpoint is the full URL; the generic one (and the argument) is a base URL.
        signal_env = os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT") if endpoint is None else None
        raw = endpoint or signal_env or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") \
            or f"localhost:{DEFAULT_PORTS[proto]}"
        env_insecure = _env(signal, "INSECURE")
        if insecure is None and env_insecure is not None:
            insecure = env_insecure.strip().lower() == "true"
        bare = "://" not in raw
        if bare:
            raw = ("https://" if insecure is False else "http://") + raw
        url = urlparse(raw)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ObservabilityConfigError(f"OTLP endpoint: expected 'host:port' or 'http(s)://host:port', got {raw!r}")
        if insecure is None:
            insecure = url.scheme == "http"
        # ``host`` alone means the OTLP port; a URL without a port means its scheme's (``https://api.vendor.io``: 443).
        port = url.port or (DEFAULT_PORTS[proto] if bare else 443 if url.scheme == "https" else 80)
        host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
        if proto == "grpc":
            target = f"{host}:{port}"
        else:
            path = url.path.rstrip("/")
            if not signal_env and not path.endswith(f"/v1/{signal}"):
                path = f"{path}/v1/{signal}"
            scheme = "http" if insecure else "https"
            default = url.port is None and not bare and scheme == url.scheme
            target = f"{scheme}://{host}{'' if default else f':{port}'}{path}"

        comp = (compression or _env(signal, "COMPRESSION") or "none").strip().lower()
        if comp not in ("none", "gzip", "deflate"):
            raise ObservabilityConfigError(f"OTLP compression: expected none, gzip or deflate, got {compression!r}")
        if timeout is None:
            env_timeout = _env(signal, "TIMEOUT")  # milliseconds, as the OTel specification defines it
            try:
                timeout = float(env_timeout) / 1000.0 if env_timeout else 10.0
            except ValueError:
                raise ObservabilityConfigError(
                    f"OTEL_EXPORTER_OTLP_TIMEOUT: expected milliseconds, got {env_timeout!r}") from None
        if not timeout > 0:
            raise ObservabilityConfigError(f"OTLP timeout: expected a positive number of seconds, got {timeout!r}")
        return ExportSettings(
            signal=signal, protocol=proto, endpoint=target, insecure=bool(insecure),
            headers=parse_headers(headers if headers is not None else _env(signal, "HEADERS")),
            compression=comp, timeout=float(timeout),
            certificate_file=certificate_file or _env(signal, "CERTIFICATE"),
            client_key_file=client_key_file or _env(signal, "CLIENT_KEY"),
            client_certificate_file=client_certificate_file or _env(signal, "CLIENT_CERTIFICATE"),
        )

    def describe(self) -> str:
        """For messages: protocol and endpoint, never header values."""
        return f"{self.protocol} {self.endpoint}"

    @property
    def address(self) -> str:
        """``host:port`` of the collector (the same for both signals)."""
        return self.endpoint if self.protocol == "grpc" else urlparse(self.endpoint).netloc


def _grpc_credentials(s: ExportSettings):
    if s.insecure or not (s.certificate_file or s.client_certificate_file):
        return None
    import grpc

    def read(path):
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(
        root_certificates=read(s.certificate_file) if s.certificate_file else None,
        private_key=read(s.client_key_file) if s.client_key_file else None,
        certificate_chain=read(s.client_certificate_file) if s.client_certificate_file else None,
    )


def make_metric_exporter(s: ExportSettings, **kwargs) -> MetricExporter:
    if s.protocol == "grpc":
        import grpc
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        comp = {"none": grpc.Compression.NoCompression, "gzip": grpc.Compression.Gzip,
                "deflate": grpc.Compression.Deflate}[s.compression]
        return OTLPMetricExporter(endpoint=s.endpoint, insecure=s.insecure, credentials=_grpc_credentials(s),
                                  headers=dict(s.headers), timeout=s.timeout, compression=comp, **kwargs)
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    comp = {"none": Compression.NoCompression, "gzip": Compression.Gzip, "deflate": Compression.Deflate}[s.compression]
    return OTLPMetricExporter(endpoint=s.endpoint, certificate_file=s.certificate_file,
                              client_key_file=s.client_key_file, client_certificate_file=s.client_certificate_file,
                              headers=dict(s.headers),
                              timeout=s.timeout, compression=comp, **kwargs)


def make_span_exporter(s: ExportSettings) -> SpanExporter:
    if s.protocol == "grpc":
        import grpc
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        comp = {"none": grpc.Compression.NoCompression, "gzip": grpc.Compression.Gzip,
                "deflate": grpc.Compression.Deflate}[s.compression]
        return OTLPSpanExporter(endpoint=s.endpoint, insecure=s.insecure, credentials=_grpc_credentials(s),
                                headers=dict(s.headers), timeout=s.timeout, compression=comp)
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    comp = {"none": Compression.NoCompression, "gzip": Compression.Gzip, "deflate": Compression.Deflate}[s.compression]
    return OTLPSpanExporter(endpoint=s.endpoint, certificate_file=s.certificate_file, client_key_file=s.client_key_file,
                            client_certificate_file=s.client_certificate_file, headers=dict(s.headers),
                            timeout=s.timeout, compression=comp)


# ---------------------------------------------------------------------------------------------------------------
# identity


def current_rank() -> int:
    """The global rank: Lightning's once the strategy set it, else the launcher's environment, else 0."""
    try:
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        rank = getattr(rank_zero_only, "rank", None)
        if rank is not None:
            return int(rank)
    except Exception:  # pragma: no cover - lightning is a dependency; be defensive anyway
        pass
    for key in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK", "LOCAL_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def default_run_id() -> str:
    """``ALIGN_RUN_ID`` when set, else a new ``YYYYmmdd-HHMMSS-xxxxxx``.

    Under Lightning's DDP launcher the worker processes are started from rank 0's environment after the logger is
    built, so rank 0 publishes its id in ``ALIGN_RUN_ID`` for them; the tracing callback also broadcasts it.
    """
    env = os.environ.get(RUN_ID_ENV)
    if env and os.environ.get("LOCAL_RANK", "0") != "0":
        return env  # a launched worker: take rank 0's
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def publish_run_id(run_id: str) -> None:
    if os.environ.get("LOCAL_RANK", "0") == "0":
        os.environ[RUN_ID_ENV] = run_id


def build_resource(
    *, run_id: str, rank: int, service_name: str | None, resource_attributes: Mapping[str, Any] | None,
    algorithm: str | None, model_name: str | None,
) -> Resource:
    """Defaults < ``OTEL_RESOURCE_ATTRIBUTES``/``OTEL_SERVICE_NAME`` < arguments < the run's identity."""
    from align.observability.attributes import attribute_value

    env = OTELResourceDetector().detect().attributes
    attrs: dict[str, Any] = {"service.name": "align", **env}
    if os.environ.get("OTEL_SERVICE_NAME"):
        attrs["service.name"] = os.environ["OTEL_SERVICE_NAME"]
    if service_name:
        attrs["service.name"] = service_name
    attrs.update({k: attribute_value(v) for k, v in (resource_attributes or {}).items()})
    attrs["service.instance.id"] = f"{run_id}-rank{rank}"
    attrs["align.run_id"] = run_id
    attrs["align.rank"] = rank
    if algorithm:
        attrs["align.algorithm"] = algorithm
    if model_name:
        attrs["align.model"] = model_name
    return Resource.create(attrs)


# ---------------------------------------------------------------------------------------------------------------
# failure handling


class _SdkLogCapture(logging.Filter):
    """While align exporters are active, the SDK's per-attempt export errors are not printed (one warning from
    ``DropCounter`` replaces them); the last one is kept as the reason."""

    def __init__(self):
        super().__init__()
        self.users = 0
        self.recent: collections.deque[str] = collections.deque(maxlen=32)
        self.lock = threading.Lock()
        self.loggers: list[logging.Logger] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            try:
                self.recent.append(record.getMessage())
            except Exception:
                pass
            return False
        return True

    def reason_for(self, address: str) -> str | None:
        """The latest suppressed SDK message that names this collector address, else the latest one."""
        port = address.rpartition(":")[2]
        for message in reversed(list(self.recent)):
            if address in message or f"port={port})" in message:
                return message
        return None

    def acquire(self) -> None:
        with self.lock:
            self.users += 1
            # Rescanned each time: exporter modules imported since (e.g. HTTP after gRPC) have their own loggers.
            names = [n for n in list(logging.root.manager.loggerDict)
                     if n.startswith(("opentelemetry.exporter", "opentelemetry.sdk"))]
            for lg in (logging.getLogger(n) for n in names):
                if lg not in self.loggers:
                    lg.addFilter(self)
                    self.loggers.append(lg)

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
                self.loggers = []


SDK_LOGS = _SdkLogCapture()
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


class DropCounter:
    """Counts what an exporter could not deliver and warns once per (run, endpoint) for the whole process."""

    def __init__(self, what: str, settings: ExportSettings, run_id: str):
        self.what, self.settings, self.run_id = what, settings, run_id
        self.exported = 0
        self.failed = 0
        self.dropped_in_queue = 0
        self.lock = threading.Lock()

    @property
    def dropped(self) -> int:
        return self.failed + self.dropped_in_queue

    def ok(self, n: int) -> None:
        with self.lock:
            self.exported += n

    def fail(self, n: int, reason: str | None = None) -> None:
        with self.lock:
            self.failed += n
        self.warn_once(reason or SDK_LOGS.reason_for(self.settings.address) or "no answer from the collector")

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
        log.warning("OTLP export of %s to %s is failing (%s); training continues and telemetry of this run is dropped "
                    "while it fails. This is reported once; the dropped counts are on the logger's and callback's "
                    "`dropped` attribute.", self.what, self.settings.describe(), reason or "no reason given")


class CountingMetricExporter(MetricExporter):
    """Wraps an OTLP metric exporter: counts data points delivered and dropped, never raises."""

    def __init__(self, inner: MetricExporter, counter: DropCounter):
        super().__init__(preferred_temporality=inner._preferred_temporality,
                         preferred_aggregation=inner._preferred_aggregation)
        self.inner, self.counter = inner, counter

    @staticmethod
    def _points(data: MetricsData) -> int:
        return sum(len(m.data.data_points) for rm in data.resource_metrics for sm in rm.scope_metrics
                   for m in sm.metrics)

    in_flight = 0
    abandoned = False

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        if self.abandoned:
            return MetricExportResult.FAILURE
        n = self.in_flight = self._points(metrics_data)
        try:
            result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception as err:  # an exporter bug must not reach the reader thread
            result, reason = MetricExportResult.FAILURE, repr(err)
        else:
            reason = None
        self.in_flight = 0
        if not self.abandoned:  # once abandoned, ``abandon`` has counted this batch
            (self.counter.ok(n) if result == MetricExportResult.SUCCESS else self.counter.fail(n, reason))
        return result

    def abandon(self) -> None:
        """Shutdown ran out of time: count the batch still in flight as dropped and stop the exporter."""
        self.abandoned = True
        if self.in_flight:
            self.counter.fail(self.in_flight, "the collector did not answer before the shutdown timeout")
        self.inner.shutdown()

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis)


class CountingSpanExporter(SpanExporter):
    def __init__(self, inner: SpanExporter, counter: DropCounter):
        self.inner, self.counter = inner, counter
        self.seen = 0
        self.in_flight = 0
        self.abandoned = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.seen += len(spans)
        if self.abandoned:
            self.counter.fail(len(spans), "the collector did not answer before the shutdown timeout")
            return SpanExportResult.FAILURE
        self.in_flight = len(spans)
        try:
            result = self.inner.export(spans)
        except Exception as err:
            result, reason = SpanExportResult.FAILURE, repr(err)
        else:
            reason = None
        self.in_flight = 0
        if not self.abandoned:
            (self.counter.ok(len(spans)) if result == SpanExportResult.SUCCESS
             else self.counter.fail(len(spans), reason))
        return result

    def abandon(self) -> None:
        self.abandoned = True
        if self.in_flight:
            self.counter.fail(self.in_flight, "the collector did not answer before the shutdown timeout")
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.inner.shutdown()


class CountingSpanProcessor(SpanProcessor):
    """In front of a ``BatchSpanProcessor``: spans ended minus spans handed to the exporter, beyond the queue's
    capacity, were dropped by the bounded queue; that is detected on the training thread in O(1)."""

    def __init__(self, inner: SpanProcessor, exporter: CountingSpanExporter, counter: DropCounter, max_queue_size: int):
        self.inner, self.exporter, self.counter, self.max_queue_size = inner, exporter, counter, max_queue_size
        self.ended = 0

    def on_start(self, span, parent_context=None) -> None:
        self.inner.on_start(span, parent_context=parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        self.ended += 1
        backlog = self.ended - self.exporter.seen - self.counter.dropped_in_queue
        if backlog > self.max_queue_size:
            self.counter.queue_overflow(backlog - self.max_queue_size)
        self.inner.on_end(span)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.inner.force_flush(timeout_millis)


def bounded(fn: Callable[[], Any], timeout: float, on_timeout: Callable[[], Any] | None = None) -> bool:
    """Run ``fn`` on a daemon thread and wait at most ``timeout`` seconds. On timeout, call ``on_timeout`` (which
    should make ``fn`` give up, e.g. shut the exporter down) and return False: the caller never waits longer."""
    done = threading.Event()

    def run():
        try:
            fn()
        except Exception as err:  # a failing flush must not fail training
            log.debug("OTLP flush/shutdown raised %r", err)
        finally:
            done.set()

    threading.Thread(target=run, name="align-otlp-shutdown", daemon=True).start()
    if done.wait(timeout):
        return True
    if on_timeout is not None:
        try:
            on_timeout()
        except Exception:
            pass
    return False

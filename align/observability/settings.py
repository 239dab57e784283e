"""What an OTLP export is told: :class:`ExportSettings` for one signal (metrics or traces), with the endpoint, protocol,
compression and timeout checked and normalised, and the SDK exporter built from them.

align passes the SDK exporter only what the user set on the logger or callback; everything left unset is read by the
exporter itself from the standard ``OTEL_EXPORTER_OTLP_*`` variables. align reads only what it needs itself: the
protocol (which exporter class to build) and the timeout (which also bounds the final flush).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast
from urllib.parse import urlparse

from opentelemetry.sdk.metrics.export import MetricExporter
from opentelemetry.sdk.trace.export import SpanExporter

from align.errors import AlignConfigError

Protocol_ = Literal["grpc", "http/protobuf"]
Signal = Literal["metrics", "traces"]
Compression = Literal["none", "gzip", "deflate"]
DEFAULT_PORTS = {"grpc": 4317, "http/protobuf": 4318}
DEFAULT_TIMEOUT = 10.0
_COMPRESSION = {"none": "NoCompression", "gzip": "Gzip", "deflate": "Deflate"}  # member names of both SDK enums
_EXPORTERS = {  # (protocol, signal) -> (module, class) of the SDK exporter
    ("grpc", "metrics"): ("opentelemetry.exporter.otlp.proto.grpc.metric_exporter", "OTLPMetricExporter"),
    ("grpc", "traces"): ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "OTLPSpanExporter"),
    ("http/protobuf", "metrics"): ("opentelemetry.exporter.otlp.proto.http.metric_exporter", "OTLPMetricExporter"),
    ("http/protobuf", "traces"): ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "OTLPSpanExporter"),
}


class ObservabilityConfigError(AlignConfigError):
    """A bad OTLP setting (protocol, endpoint, compression, timeout)."""


def _env(signal: Signal, name: str) -> tuple[str, str] | None:
    """``(variable, value)`` of ``OTEL_EXPORTER_OTLP_<SIGNAL>_<NAME>``, else of ``OTEL_EXPORTER_OTLP_<NAME>``."""
    for key in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_{name}", f"OTEL_EXPORTER_OTLP_{name}"):
        if os.environ.get(key):
            return key, os.environ[key]
    return None


@dataclass(frozen=True)
class ExportSettings:
    """What the user set for one signal; ``None`` leaves the setting to the SDK exporter (environment, default)."""

    signal: Signal
    protocol: Protocol_
    timeout: float  # seconds, per export and for the final flush
    endpoint: str | None = None  # grpc: "host:port"; http: the full URL of the signal's path
    insecure: bool | None = None
    headers: dict[str, str] | None = None
    compression: Compression | None = None
    certificate_file: str | None = None

    @staticmethod
    def resolve(
        signal: Signal,
        *,
        endpoint: str | None = None,
        protocol: str | None = None,
        headers: Mapping[str, str] | None = None,
        insecure: bool | None = None,
        compression: str | None = None,
        timeout: float | None = None,
        certificate_file: str | None = None,
        where: str = "trainer.logger",
    ) -> ExportSettings:
        """Check and normalise the arguments. The protocol picks the exporter class, so it is read here (argument,
        then ``OTEL_EXPORTER_OTLP_[<SIGNAL>_]PROTOCOL``); so is the timeout, in milliseconds as the specification
        says (the SDK reads that variable in seconds), because it also bounds the final flush. ``where``: the
        setting that holds the arguments (``trainer.logger``), named by their errors; a bad environment variable is
        named by itself."""
        env_proto = _env(signal, "PROTOCOL")
        proto = (protocol or (env_proto[1] if env_proto else "grpc")).strip().lower()
        proto = {"http": "http/protobuf", "http/proto": "http/protobuf"}.get(proto, proto)
        if proto not in DEFAULT_PORTS:
            if protocol:
                source = f"{where}.protocol"
            else:  # read from the variable: without one, proto is the default, grpc
                assert env_proto is not None
                source = env_proto[0]
            raise ObservabilityConfigError(f"{source}: expected 'grpc' or 'http/protobuf', got {proto!r}")
        if compression is not None and compression.strip().lower() not in _COMPRESSION:
            raise ObservabilityConfigError(f"{where}.compression: expected none, gzip or deflate, got {compression!r}")
        source = f"{where}.timeout"
        if timeout is None:
            env_timeout = _env(signal, "TIMEOUT")
            try:
                timeout = float(env_timeout[1]) / 1000.0 if env_timeout else DEFAULT_TIMEOUT
            except ValueError:
                assert env_timeout is not None  # only the variable's value can fail to parse
                raise ObservabilityConfigError(
                    f"{env_timeout[0]}: expected milliseconds, got {env_timeout[1]!r}"
                ) from None
            if env_timeout and not timeout > 0:
                raise ObservabilityConfigError(
                    f"{env_timeout[0]}: expected a positive number of milliseconds, got {env_timeout[1]!r}"
                )
        if not timeout > 0:
            raise ObservabilityConfigError(f"{source}: expected a positive number of seconds, got {timeout!r}")
        if endpoint is not None:
            endpoint, insecure = _normalise_endpoint(endpoint, proto, signal, insecure, where)
        # the protocol and the compression are checked above (against DEFAULT_PORTS and _COMPRESSION)
        return ExportSettings(
            signal=signal,
            protocol=cast(Protocol_, proto),
            timeout=float(timeout),
            endpoint=endpoint,
            insecure=insecure,
            headers={str(k).strip().lower(): str(v) for k, v in headers.items()} if headers is not None else None,
            compression=cast(Compression, compression.strip().lower()) if compression is not None else None,
            certificate_file=certificate_file,
        )

    @property
    def address(self) -> str:
        """``host:port`` (or URL) of the collector, for messages; never header values."""
        endpoint = self.endpoint
        if endpoint is None:  # as the SDK exporter will find it
            found = _env(self.signal, "ENDPOINT")
            endpoint = found[1] if found else f"localhost:{DEFAULT_PORTS[self.protocol]}"
        return urlparse(endpoint).netloc or endpoint

    def describe(self) -> str:
        return f"{self.protocol} {self.address}"

    def exporter(self) -> MetricExporter | SpanExporter:
        """The SDK exporter of this signal and protocol, given only the settings the user made."""
        module, name = _EXPORTERS[(self.protocol, self.signal)]
        grpc = self.protocol == "grpc"
        compression = None
        if self.compression is not None:
            enum = importlib.import_module("grpc" if grpc else "opentelemetry.exporter.otlp.proto.http").Compression
            compression = getattr(enum, _COMPRESSION[self.compression])
        kwargs = dict(endpoint=self.endpoint, headers=self.headers, timeout=self.timeout, compression=compression)
        try:
            if grpc:
                kwargs.update(insecure=self.insecure, credentials=_grpc_credentials(self.certificate_file))
            else:
                kwargs.update(certificate_file=self.certificate_file)
            return getattr(importlib.import_module(module), name)(**{k: v for k, v in kwargs.items() if v is not None})
        except Exception as err:  # an unreadable certificate, an OTEL_EXPORTER_OTLP_COMPRESSION the SDK refuses, ...
            raise ObservabilityConfigError(f"OTLP {self.signal} exporter: {err}") from None


def _normalise_endpoint(
    raw: str, proto: str, signal: Signal, insecure: bool | None, where: str = "trainer.logger"
) -> tuple[str, bool | None]:
    """An endpoint argument: ``host[:port]`` is plain text on the OTLP port, ``https://host`` is TLS on 443; for
    HTTP ``/v1/<signal>`` is appended to the base URL. Returns the SDK's form and the ``insecure`` flag."""
    bare = "://" not in raw
    url = urlparse((("https://" if insecure is False else "http://") + raw) if bare else raw)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ObservabilityConfigError(f"{where}.endpoint: expected 'host:port' or 'http(s)://host:port', got {raw!r}")
    insecure = url.scheme == "http" if insecure is None else insecure
    port = url.port or (DEFAULT_PORTS[proto] if bare else 443 if url.scheme == "https" else 80)
    host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
    if proto == "grpc":
        return f"{host}:{port}", insecure
    path = url.path.rstrip("/")
    if not path.endswith(f"/v1/{signal}"):
        path = f"{path}/v1/{signal}"
    scheme = "http" if insecure else "https"
    default_port = url.port is None and not bare and scheme == url.scheme
    return f"{scheme}://{host}{'' if default_port else f':{port}'}{path}", None


def _grpc_credentials(certificate_file: str | None):
    if certificate_file is None:
        return None
    import grpc

    with open(certificate_file, "rb") as f:
        return grpc.ssl_channel_credentials(root_certificates=f.read())

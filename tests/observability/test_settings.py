"""Export settings (align.observability.settings): resolved from arguments, left to the SDK's exporter where unset
(which then reads the standard environment), and one-line errors for bad settings."""

import pytest

from align.errors import AlignConfigError
from align.observability import OTelTracingCallback, OTLPLogger
from align.observability.settings import ExportSettings, ObservabilityConfigError


def by_name(points):
    out = {}
    for p in points:
        out.setdefault(p.metric, []).append(p)
    return out


def test_settings_from_arguments():
    s = ExportSettings.resolve(
        "metrics", endpoint="127.0.0.1:9999", protocol="grpc", headers={"X-Key": "v"}, compression="gzip", timeout=2.5
    )
    assert (s.endpoint, s.insecure, s.headers, s.compression, s.timeout) == (
        "127.0.0.1:9999",
        True,
        {"x-key": "v"},
        "gzip",
        2.5,
    )
    h = ExportSettings.resolve("traces", endpoint="https://otel.example.com", protocol="http/protobuf")
    assert h.endpoint == "https://otel.example.com/v1/traces"  # TLS on the URL's own default port
    assert ExportSettings.resolve("traces", endpoint="https://otel.example.com").endpoint == "otel.example.com:443"
    assert ExportSettings.resolve("traces", endpoint="collector").endpoint == "collector:4317"
    assert (
        ExportSettings.resolve("traces", endpoint="collector", protocol="http").endpoint
        == "http://collector:4318/v1/traces"
    )
    h = ExportSettings.resolve("metrics", endpoint="http://host:1234/otlp/", protocol="http")
    assert h.endpoint == "http://host:1234/otlp/v1/metrics"  # plain text: the scheme says so


def test_unset_settings_are_left_to_the_sdk_exporter(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "2500")  # milliseconds, as the specification says
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    t = ExportSettings.resolve("traces")
    assert (t.protocol, t.timeout, t.endpoint, t.headers, t.compression, t.insecure) == (
        "http/protobuf",
        2.5,
        None,
        None,
        None,
        None,
    )
    assert t.address == "collector:4318"  # for messages: where the SDK exporter will send
    assert ExportSettings.resolve("metrics").timeout == 10.0
    # arguments win over the environment
    m = ExportSettings.resolve("metrics", endpoint="localhost:1", protocol="grpc", timeout=3)
    assert (m.protocol, m.endpoint, m.timeout) == ("grpc", "localhost:1", 3)


def test_bad_settings_fail_with_a_clear_message(monkeypatch):
    with pytest.raises(
        AlignConfigError,
        match=r"^trainer\.logger\.protocol: expected 'grpc' or 'http/protobuf', got "
        r"'thrift'$",
    ):
        ExportSettings.resolve("metrics", protocol="thrift")
    with pytest.raises(
        ObservabilityConfigError,
        match=r"^trainer\.logger\.compression: expected none, gzip or "
        r"deflate, got 'zstd'$",
    ):
        ExportSettings.resolve("metrics", compression="zstd")
    with pytest.raises(
        ObservabilityConfigError,
        match=r"^trainer\.callbacks\.timeout: expected a positive number of "
        r"seconds, got 0$",
    ):
        ExportSettings.resolve("traces", timeout=0, where="trainer.callbacks")
    with pytest.raises(
        ObservabilityConfigError,
        match=r"^trainer\.logger\.endpoint: expected 'host:port' or "
        r"'http\(s\)://host:port', got 'ftp://collector'$",
    ):
        ExportSettings.resolve("metrics", endpoint="ftp://collector")
    with pytest.raises(
        ObservabilityConfigError,
        match=r"^trainer\.logger\.export_interval: expected positive seconds, "
        r"got 0$",
    ):
        OTLPLogger(export_interval=0)
    for name in ("max_queue_size", "max_export_batch_size", "step_every_n"):
        with pytest.raises(ObservabilityConfigError, match=rf"^trainer\.callbacks\.{name}: expected >= 1, got 0$"):
            OTelTracingCallback(**{name: 0})
    with pytest.raises(
        ObservabilityConfigError,
        match=r"^trainer\.callbacks\.compression: expected none, gzip or "
        r"deflate, got 'zstd'$",
    ):
        OTelTracingCallback(compression="zstd")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "thrift")
    with pytest.raises(
        ObservabilityConfigError,
        match=r"^OTEL_EXPORTER_OTLP_METRICS_PROTOCOL: expected 'grpc' or "
        r"'http/protobuf', got 'thrift'$",
    ):
        ExportSettings.resolve("metrics")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd")  # refused by the SDK's gRPC exporter
    with pytest.raises(ObservabilityConfigError, match="OTEL_EXPORTER_OTLP_COMPRESSION"):
        ExportSettings.resolve("metrics").exporter()


def test_the_sdk_exporter_reads_the_standard_environment(receiver, monkeypatch):
    """Nothing set on the logger: endpoint, headers and compression come from OTEL_* through the SDK exporter."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint("http/protobuf"))  # a base URL
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "api-key=s%20ecret,x-team=rl")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "align-grpo")
    logger = OTLPLogger(export_interval=60)
    logger.log_metrics({"train/kl": 0.5}, step=1)
    logger.finalize("success")
    kl = by_name(receiver.points("http"))["align.train.kl"][-1]
    assert kl.value == 0.5 and kl.resource["service.name"] == "align-grpo"
    assert receiver.headers[-1]["api-key"] == "s ecret" and receiver.headers[-1]["content-encoding"] == "gzip"
    assert logger.dropped == 0

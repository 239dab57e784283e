"""Naming, redaction and settings resolution: pure functions, no exporter involved."""

import subprocess
import sys

import pytest

from align.errors import AlignConfigError
from align.observability import OTelTracingCallback, OTLPLogger
from align.observability.attributes import (
    REDACTED,
    algorithm_of,
    flatten,
    hparam_attributes,
    is_secret_key,
    metric_name,
)
from align.observability.settings import ExportSettings, ObservabilityConfigError


@pytest.mark.parametrize(
    "name, expected",
    [
        ("train/kl", "align.train.kl"),
        ("rollout/reward_mean", "align.rollout.reward_mean"),
        ("val/reward_mean", "align.val.reward_mean"),
        ("epoch", "align.epoch"),
        ("train/loss step", "align.train.loss_step"),
        ("dpo/rewards_chosen", "align.dpo.rewards_chosen"),
    ],
)
def test_metric_names_follow_the_documented_scheme(name, expected):
    assert metric_name(name) == expected


def test_metric_name_without_prefix_still_starts_with_a_letter():
    assert metric_name("train/kl", prefix="") == "train.kl"
    assert metric_name("0/x", prefix="") == "m_0.x"


@pytest.mark.parametrize(
    "key",
    [
        "hf_token",
        "api_key",
        "wandb.api_key",
        "OPENAI_API_KEY",
        "password",
        "db.passwd",
        "Authorization",
        "client_secret",
        "apiKey",
        "headers.authorization",
        "token",
    ],
)
def test_secret_keys_are_recognised(key):
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key", ["max_new_tokens", "tokenizer", "num_tokens", "model", "lr", "monkey", "kl_coef", "keys_total", "capital"]
)
def test_ordinary_keys_are_not_secrets(key):
    assert not is_secret_key(key)


def test_hparams_are_flattened_and_redacted():
    params = {
        "model": {
            "class_path": "align.modules.GRPOModule",
            "init_args": {"beta": 0.04, "max_new_tokens": 32, "hf_token": "hf_abc", "api": {"key": "k"}},
        },
        "reward": {"auth_header": "Bearer abc.def"},
        "note": "Bearer xyz",
        "lr": 1e-3,
        "_private": 1,
        "tags": ["a", "b"],
        "obj": object(),
    }
    attrs = hparam_attributes(params)
    assert attrs["hparam.model.class_path"] == "align.modules.GRPOModule"
    assert attrs["hparam.model.init_args.beta"] == 0.04
    assert attrs["hparam.model.init_args.max_new_tokens"] == 32
    assert attrs["hparam.model.init_args.hf_token"] == REDACTED
    assert attrs["hparam.model.init_args.api.key"] == REDACTED
    assert attrs["hparam.reward.auth_header"] == REDACTED
    assert attrs["hparam.note"] == REDACTED  # a bearer credential under an innocent key
    assert attrs["hparam.tags"] == ["a", "b"]
    assert isinstance(attrs["hparam.obj"], str)
    assert not any("_private" in k for k in attrs)


def test_flatten_handles_empty_and_scalar_values():
    assert flatten({}) == {}
    assert flatten({"a": {}, "b": 1}) == {"a": {}, "b": 1}


def test_algorithm_names():
    class SFTModule: ...

    class GRPOModule: ...

    assert algorithm_of(SFTModule()) == "sft" and algorithm_of(GRPOModule()) == "grpo" and algorithm_of(None) is None


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


def test_the_timer_does_not_import_opentelemetry():
    code = (
        "import sys, align.observability as o\n"
        "timings = {}\n"
        "with o.Timer(timings, 'time/generation_s'): pass\n"
        "assert timings['time/generation_s'] >= 0\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'opentelemetry imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

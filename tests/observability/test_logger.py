"""The OTLP metrics logger (align.observability.logger) against an in-process OTLP receiver: metric names, values,
attributes and histograms, histogram patterns and buckets, and logging again after finalize."""

import pytest

from align.observability import OTLPLogger
from align.observability.attributes import REDACTED

PROTOCOLS = ["grpc", "http/protobuf"]


def by_name(points):
    out = {}
    for p in points:
        out.setdefault(p.metric, []).append(p)
    return out


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_logger_exports_names_values_attributes_and_histograms(receiver, protocol, monkeypatch):
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=ci,team=rl")
    logger = OTLPLogger(
        endpoint=receiver.endpoint(protocol),
        protocol=protocol,
        run_id="run-1",
        algorithm="grpo",
        model_name="tiny",
        headers={"x-api-key": "s3cret"},
        compression="gzip",
        export_interval=60,
        histogram_metrics=["rollout/*_length"],
    )
    logger.log_hyperparams(
        {
            "model": {"beta": 0.04, "hf_token": "hf_abcdefghijklmnopqrstuvwxyz"},
            "reward": {"api_key": "k", "max_new_tokens": 32},
        }
    )
    logger.log_metrics({"train/kl": 0.125, "rollout/reward_mean": 0.5, "epoch": 0.0}, step=3)
    logger.log_metrics({"train/kl": 0.25}, step=4)  # a gauge exports the last value
    for length in (3, 5, float("nan"), 8):
        logger.log_metrics({"rollout/response_length": length})
    logger.finalize("success")

    transport = "grpc" if protocol == "grpc" else "http"
    points = by_name(receiver.points(transport))
    assert points["align.train.kl"][-1].value == 0.25
    assert points["align.rollout.reward_mean"][-1].value == 0.5
    assert points["align.step"][-1].value == 4
    assert "align.epoch" in points
    length = points["align.rollout.response_length"][-1]
    assert length.kind == "exponential_histogram" and length.count == 3 and length.sum == 16  # NaN skipped
    assert logger.skipped_non_finite == 1
    kl = points["align.train.kl"][-1]
    assert kl.attributes == {"align.run_id": "run-1", "align.rank": 0, "align.algorithm": "grpo", "align.model": "tiny"}
    assert kl.resource["service.name"] == "align" and kl.resource["service.instance.id"] == "run-1-rank0"
    assert kl.resource["deployment.environment"] == "ci" and kl.resource["team"] == "rl"
    info = points["align.run.info"][-1].attributes
    assert info["hparam.model.beta"] == 0.04 and info["hparam.reward.max_new_tokens"] == 32
    assert info["hparam.model.hf_token"] == REDACTED and info["hparam.reward.api_key"] == REDACTED
    assert "hf_abcdefghijklmnopqrstuvwxyz" not in repr(receiver.metric_requests)
    assert receiver.headers[-1]["x-api-key"] == "s3cret"
    assert logger.dropped == 0


def test_histogram_patterns_and_explicit_buckets(receiver):
    logger = OTLPLogger(
        endpoint=receiver.endpoint("grpc"),
        histogram_metrics=["rollout/*_length"],
        histogram_boundaries=[0, 10, 100],
        export_interval=60,
    )
    for v in (4.0, 20.0):
        logger.log_metrics({"rollout/response_length": v, "train/loss": 1.0}, step=1)
    logger.finalize("success")
    points = by_name(receiver.points())
    hist = points["align.rollout.response_length"][-1]
    assert hist.kind == "histogram" and hist.count == 2 and hist.sum == 24.0
    assert points["align.train.loss"][-1].kind == "gauge"


def test_logger_can_log_again_after_finalize(receiver):
    logger = OTLPLogger(endpoint=receiver.endpoint("grpc"), export_interval=60, run_id="r")
    logger.log_metrics({"val/loss": 2.0})
    logger.finalize("success")
    logger.log_metrics({"val/loss": 1.0})  # the CLI validates again after fit
    logger.finalize("success")
    assert [p.value for p in receiver.points() if p.metric == "align.val.loss"] == [2.0, 1.0]

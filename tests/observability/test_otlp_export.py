"""The logger and the tracing callback against an in-process OTLP receiver (gRPC and HTTP/protobuf)."""

import socket
import threading

import pytest

from align.observability import OTelTracingCallback, OTLPLogger, Timer, timing
from align.observability.attributes import REDACTED
from align.observability.export import SDK_LOGS, _failures, _names

from ._toy import ToyRLModule, toy_trainer

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


def span_tree(spans):
    by_id = {s.span_id: s for s in spans}
    return by_id, (lambda s: by_id.get(s.parent_span_id))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_training_exports_the_span_tree_and_metrics(receiver, protocol, tmp_path):
    endpoint = receiver.endpoint(protocol)
    logger = OTLPLogger(endpoint=endpoint, protocol=protocol, export_interval=60)
    callback = OTelTracingCallback(endpoint=endpoint, protocol=protocol, export_interval=60)
    trainer = toy_trainer(tmp_path, logger=logger, callbacks=[callback], max_steps=3)
    module = ToyRLModule()
    trainer.fit(module)
    assert timing._active is None  # torn down after fit
    assert set(module.timings) == {"time/generation_s", "time/scoring_s", "time/update_s"}

    spans = receiver.spans()
    by_id, parent = span_tree(spans)
    names = [s.name for s in spans]
    assert names.count("fit") == 1 and names.count("epoch") == 1 and names.count("step") == 3
    fit = next(s for s in spans if s.name == "fit")
    assert fit.parent_span_id == "" and fit.attributes["align.algorithm"] == "toyrl"
    assert fit.resource["align.run_id"] == logger.run_id == callback.run_id  # one run id for both signals
    assert fit.resource["service.instance.id"] == f"{logger.run_id}-rank0"
    assert fit.attributes["hparam.beta"] == 0.04 and fit.attributes["hparam.hf_token"] == REDACTED
    assert "hf_0123456789abcdefghij" not in repr(receiver.trace_requests) + repr(receiver.metric_requests)
    info = next(p for p in receiver.points() if p.metric == "align.run.info").attributes
    assert info["hparam.hf_token"] == REDACTED and info["hparam.beta"] == 0.04
    for s in spans:
        assert s.trace_id == fit.trace_id
    steps = [s for s in spans if s.name == "step"]
    for step in steps:
        assert parent(step).name == "epoch" and parent(parent(step)).name == "fit"
        assert step.attributes["align.batch.size"] == 4
        assert step.attributes["align.train.kl"] == 0.25
        assert step.attributes["align.rollout.reward_mean"] == 0.75
        children = sorted((s for s in spans if s.parent_span_id == step.span_id), key=lambda s: s.start)
        assert [c.name for c in children] == ["generation", "scoring", "update"]  # the module's Timer sections
        assert step.start <= children[0].start and all(c.end <= step.end for c in children)
    assert [s.attributes["align.step"] for s in steps] == [0, 1, 2]

    points = by_name(receiver.points())
    assert points["align.train.kl"][-1].value == 0.25
    assert points["align.train.kl"][-1].attributes["align.algorithm"] == "toyrl"


def test_a_grpo_step_has_the_documented_section_spans(receiver, tmp_path):
    """A real GRPO step on the tiny model: its Timer sections are spans named as docs/observability.md says, children
    of the step span, and the same blocks still give the time/* metrics."""
    from torch.utils.data import DataLoader

    from align.data.chat import ChatEncoder
    from align.data.prompts import PromptBatch
    from align.models.policy import PolicyModel
    from align.modules.grpo import GRPOModule
    from align.rollout.engine import SamplingConfig

    policy = PolicyModel("tiny", seed=2)
    prompt = "sort: b a"
    batch = PromptBatch([ChatEncoder(policy.tokenizer).prompt_ids([{"role": "user", "content": prompt}])], [prompt], {})
    module = GRPOModule(
        policy=policy,
        rewards=[lambda prompts, completions, **kw: [1.0] * len(completions)],
        group_size=2,
        sampling=SamplingConfig(max_new_tokens=4),
    )
    callback = OTelTracingCallback(endpoint=receiver.endpoint("grpc"), export_interval=60)
    toy_trainer(tmp_path, logger=False, callbacks=[callback], max_steps=1).fit(
        module, train_dataloaders=DataLoader([batch], batch_size=None)
    )
    spans = receiver.spans()
    step = next(s for s in spans if s.name == "step")
    children = sorted((s for s in spans if s.parent_span_id == step.span_id), key=lambda s: s.start)
    assert [c.name for c in children] == ["generation", "scoring", "update"]
    assert set(module.timings) == {"time/generation_s", "time/scoring_s", "time/update_s"}


class TwoTurns:
    """Replies once, then ends: reward 0.5 a turn."""

    def reset(self, row):
        self.turn = 0
        return row["messages"]

    def step(self, message):
        self.turn += 1
        from align.rollout.envs.chat import EnvStep

        return EnvStep([] if self.turn == 2 else [{"role": "user", "content": "sort: c a"}], 0.5, self.turn == 2)


def test_every_environment_call_of_a_multi_turn_rollout_is_a_span_under_generation(receiver, tmp_path):
    from torch.utils.data import DataLoader

    from align.data.chat import ChatEncoder
    from align.data.prompts import PromptBatch
    from align.models.policy import PolicyModel
    from align.modules.grpo import GRPOModule
    from align.rollout.engine import SamplingConfig
    from align.rollout.envs.chat import EnvironmentSpec

    policy = PolicyModel("tiny", seed=2)
    messages = [[{"role": "user", "content": p}] for p in ("sort: b a", "sort: d c")]
    encode = ChatEncoder(policy.tokenizer).prompt_ids
    batch = PromptBatch([encode(m) for m in messages], ["sort: b a", "sort: d c"], {}, messages)
    module = GRPOModule(
        policy=policy,
        environment=EnvironmentSpec(TwoTurns, max_tokens=40),
        group_size=2,
        sampling=SamplingConfig(max_new_tokens=4),
    )
    callback = OTelTracingCallback(endpoint=receiver.endpoint("grpc"), export_interval=60)
    logger = OTLPLogger(endpoint=receiver.endpoint("grpc"), export_interval=60)
    toy_trainer(tmp_path, logger=logger, callbacks=[callback], max_steps=1).fit(
        module, train_dataloaders=DataLoader([batch], batch_size=None)
    )
    names = {p.metric for p in receiver.points()}
    assert {
        "align.rollout.turns",
        "align.rollout.environment_tokens",
        "align.rollout.truncated_frac",
        "align.rollout.reward.env",
        "align.time.env_s",
    } <= names
    spans = receiver.spans()
    generation = next(s for s in spans if s.name == "generation")
    calls = [s for s in spans if s.name == "env_step"]
    episodes = module.last_metrics["rollout/turns"] * 4
    assert len(calls) == episodes > 0
    assert all(s.parent_span_id == generation.span_id for s in calls)
    assert all(generation.start <= s.start <= s.end <= generation.end for s in calls)
    assert {s.attributes["align.env.name"] for s in calls} == {"TwoTurns"}
    assert sorted((s.attributes["align.env.episode"], s.attributes["align.env.turn"]) for s in calls)[0] == (0, 1)
    assert all(s.attributes["align.env.reward"] == 0.5 for s in calls)
    assert {s.attributes["align.env.done"] for s in calls} <= {True, False}


def test_checkpoint_saves_and_validation_are_spans(receiver, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    class WithVal(ToyRLModule):
        def validation_step(self, batch, batch_idx):
            self.log("val/reward_mean", 1.0)

        def val_dataloader(self):
            return self.train_dataloader()

    callback = OTelTracingCallback(endpoint=receiver.endpoint("grpc"), export_interval=60)
    trainer = toy_trainer(
        tmp_path,
        logger=False,
        max_steps=2,
        limit_val_batches=1,
        val_check_interval=2,
        enable_checkpointing=True,
        callbacks=[callback, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1)],
    )
    trainer.fit(WithVal())
    spans = receiver.spans()
    by_id, parent = span_tree(spans)
    saves = [s for s in spans if s.name == "checkpoint_save"]
    assert len(saves) >= 2
    assert all(parent(s).name in ("epoch", "validation") for s in saves)
    assert all(s.attributes["align.checkpoint.path"].endswith(".ckpt") for s in saves)
    # without an OTLPLogger the callback reads Lightning's metrics on logging steps (every step here)
    assert all(s.attributes["align.train.kl"] == 0.25 for s in spans if s.name == "step")
    val = [s for s in spans if s.name == "validation"]
    assert len(val) == 1 and parent(val[0]).name == "epoch"


def test_exceptions_are_recorded_as_span_events(receiver, tmp_path):
    callback = OTelTracingCallback(endpoint=receiver.endpoint("grpc"), export_interval=60)
    trainer = toy_trainer(tmp_path, logger=False, callbacks=[callback], max_steps=5)
    with pytest.raises(RuntimeError, match="exploded"):
        trainer.fit(ToyRLModule(fail_at_step=1))
    spans = receiver.spans()
    failed = [s for s in spans if s.events]
    assert [s.name for s in failed] == ["generation", "step"]  # the Timer section, then the step around it
    for s in failed:
        name, attrs = s.events[0]
        assert name == "exception" and attrs["exception.type"] == "RuntimeError"
        assert "exploded" in attrs["exception.message"]
        assert s.status_code == 2  # STATUS_CODE_ERROR
    assert next(s for s in spans if s.name == "fit").status_code == 2


def test_timer_without_the_callback_only_adds_seconds():
    timings = {"time/update_s": 1.0}
    with Timer(timings, "time/update_s") as t:
        pass
    assert t.span is None and timings["time/update_s"] >= 1.0
    assert timing.span_name("time/generation_s") == "generation" and timing.span_name("time/scoring_s") == "scoring"


def test_timer_sections_from_other_threads_nest_under_the_step(receiver, tmp_path):
    class Threaded(ToyRLModule):
        def training_step(self, batch, batch_idx):
            timings = {}

            def generate():  # a worker thread has no current span: its section nests under the step
                with Timer(timings, "time/generation_s"):
                    pass

            with Timer(timings, "time/update_s"):
                t = threading.Thread(target=generate)
                t.start()
                t.join()
            return self.layer(batch[0]).sum()

    callback = OTelTracingCallback(endpoint=receiver.endpoint("grpc"), export_interval=60)
    toy_trainer(tmp_path, logger=False, callbacks=[callback], max_steps=1).fit(Threaded())
    spans = receiver.spans()
    _, parent = span_tree(spans)
    gen = next(s for s in spans if s.name == "generation")
    assert parent(gen).name == "step"


# ------------------------------------------------------------------------------------------------ failures


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_collector_down_training_finishes_with_a_single_warning(tmp_path, protocol, warning_counter):
    port = closed_port()
    endpoint = f"127.0.0.1:{port}" if protocol == "grpc" else f"http://127.0.0.1:{port}"
    logger = OTLPLogger(endpoint=endpoint, protocol=protocol, export_interval=0.05, timeout=2)
    callback = OTelTracingCallback(endpoint=endpoint, protocol=protocol, export_interval=0.05, timeout=2)
    trainer = toy_trainer(tmp_path, logger=logger, callbacks=[callback], max_steps=6)
    trainer.fit(ToyRLModule())
    assert trainer.global_step == 6
    assert logger.dropped > 0 and callback.dropped > 0
    warnings = warning_counter.relevant()
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].name == "align.observability" and f"127.0.0.1:{port}" in warnings[0].getMessage()


def test_full_span_queue_drops_are_counted_and_warned_once(tmp_path, warning_counter):
    callback = OTelTracingCallback(
        endpoint=f"127.0.0.1:{closed_port()}", export_interval=60, max_queue_size=4, max_export_batch_size=4, timeout=1
    )
    toy_trainer(tmp_path, logger=False, callbacks=[callback], max_steps=6).fit(ToyRLModule())
    assert callback.dropped >= 6 * 4 - 4  # 6 steps x (step + 3 sections) spans, 4 fit in the queue
    assert len(warning_counter.relevant()) == 1


def silent_server():
    """A TCP server that accepts connections and never answers: the slowest possible collector."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    conns = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conns.append(server.accept()[0])
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()

    def close():
        stop.set()
        for c in conns:
            c.close()
        server.close()

    return server.getsockname()[1], close


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shutdown_never_waits_longer_than_the_timeout(protocol):
    port, close = silent_server()
    try:
        endpoint = f"127.0.0.1:{port}" if protocol == "grpc" else f"http://127.0.0.1:{port}"
        logger = OTLPLogger(endpoint=endpoint, protocol=protocol, timeout=1.0, export_interval=60)
        for step in range(5):
            logger.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
        exporter = logger._pipeline.exporter
        logger.finalize("success")
        # The request failed at its deadline or was given up at shutdown; either way it is counted as dropped.
        assert logger.dropped > 0 and (exporter.abandoned or not exporter.in_flight)
    finally:
        close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_final_flush_to_a_refusing_collector_stops_at_the_first_retry(protocol):
    """The SDK exporter retries a refused export with backoff (1, 2, 4 s within its timeout): the final flush of a
    stage must not sit through that. It gives up at the SDK's first retry, before any second attempt."""
    port = closed_port()
    endpoint = f"127.0.0.1:{port}" if protocol == "grpc" else f"http://127.0.0.1:{port}"
    logger = OTLPLogger(endpoint=endpoint, protocol=protocol, timeout=10, export_interval=60)
    logger.log_metrics({"train/loss": 1.0}, step=0)  # no export before the final flush: the collector is untried
    assert not _failures[f"127.0.0.1:{port}"]
    exporter = logger._pipeline.exporter
    SDK_LOGS.recent.clear()
    logger.finalize("success")
    # Given up, not waited out: a flush that sat through the backoff would end on its own, with nothing abandoned.
    assert exporter.abandoned and logger.dropped > 0
    # This collector's retries only: an exporter abandoned by an earlier test may still log its own on its thread.
    retries = [m for m in SDK_LOGS.recent if "retrying" in m and _names(m, f"127.0.0.1:{port}")]
    assert len(retries) == 1, retries  # no second retry was scheduled
    assert _failures[f"127.0.0.1:{port}"]  # the next stage's flush waits at most one second


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_warning_for_a_refusing_collector_says_the_connection_was_refused(protocol, caplog):
    """A closed port is given up at the first retry, at shutdown: the warning names the refused connection (what the
    SDK said), not a shutdown timeout that never ran out."""
    port = closed_port()
    endpoint = f"127.0.0.1:{port}" if protocol == "grpc" else f"http://127.0.0.1:{port}"
    logger = OTLPLogger(endpoint=endpoint, protocol=protocol, timeout=10, export_interval=60)
    logger.log_metrics({"train/loss": 1.0}, step=0)
    with caplog.at_level("WARNING", logger="align.observability"):
        logger.finalize("success")
    warnings = [r.getMessage() for r in caplog.records if "is failing" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"(the connection was refused: nothing listens at 127.0.0.1:{port})" in warnings[0]
    assert "shutdown timeout" not in warnings[0]


def test_sdk_messages_are_condensed_to_their_cause():
    from align.observability.export import condensed

    assert (
        condensed(
            "Transient error HTTPConnectionPool(host='h', port=1): ... [Errno -2] Name or service not known", "h:1"
        )
        == "the collector's host name does not resolve"
    )
    assert (
        condensed(
            "Transient error StatusCode.DEADLINE_EXCEEDED encountered while exporting metrics to h:1, retrying in 1s.",
            "h:1",
        )
        == "the collector did not answer in time"
    )
    assert condensed("something else\nsecond line", "h:1") == "something else"

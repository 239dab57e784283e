"""Exporting to a collector (align.observability.export), with the logger and the tracing callback against an
in-process OTLP receiver (gRPC and HTTP/protobuf) or a collector that is down: one warning for a collector that
refuses, drops counted, shutdown and final flushes bounded, the SDK's messages condensed to their cause, and how long
the logger's methods and the callback's hooks hold the training thread.

On the last: each logger method and callback hook is wrapped to time the calls made on the training thread, over
the CLI's three stages (held-out validation, fit, validation again), and every call is checked against the bound that
docs/observability.md states. Nothing here times the whole run."""

import logging
import socket
import threading
import time

import pytest
from lightning.pytorch.callbacks import Callback

from align.observability import OTelTracingCallback, OTLPLogger
from align.observability.export import FAILING_WAIT, SDK_LOGS, _failures, _names

from ._toy import ToyRLModule, toy_trainer

PROTOCOLS = ["grpc", "http/protobuf"]


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


# ---------------------------------------------------------------------------------- how long hooks hold training
# Scheduling delay allowed on top of a documented bound: the flush waits on another thread, which a loaded 2-core
# machine may not run at once.
SLACK = 0.5
LOGGER_METHODS = ("log_hyperparams", "log_graph", "log_metrics", "save", "after_save_checkpoint", "finalize")
CALLBACK_HOOKS = tuple(n for n in dir(Callback) if n.startswith("on_") or n in ("setup", "teardown"))
FLUSHES = ("OTLPLogger.finalize", "OTelTracingCallback.teardown")  # the end-of-stage flushes


class HookClock:
    """Times every call of the wrapped methods: ``calls`` holds ``(name, seconds)`` in call order."""

    def __init__(self):
        self.calls: list[tuple[str, float]] = []

    def wrap(self, obj, names) -> None:
        for name in names:
            method = getattr(obj, name)

            def timed(*args, _method=method, _name=f"{type(obj).__name__}.{name}", **kwargs):
                start = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    self.calls.append((_name, time.perf_counter() - start))

            setattr(obj, name, timed)

    def over(self, bound: float) -> list[tuple[str, float]]:
        return [(name, round(s, 3)) for name, s in self.calls if s > bound]


class WithValidation(ToyRLModule):
    def validation_step(self, batch, batch_idx):
        self.log("val/reward_mean", 1.0)

    def val_dataloader(self):
        return self.train_dataloader()


def endpoint_of(port: int, protocol: str) -> str:
    return f"127.0.0.1:{port}" if protocol == "grpc" else f"http://127.0.0.1:{port}"


def run_three_stages(tmp_path, endpoint: str, protocol: str, **settings) -> HookClock:
    """The CLI's flow on one trainer: validate, fit, validate; each stage starts and flushes the exporters."""
    logger = OTLPLogger(endpoint=endpoint, protocol=protocol, **settings)
    callback = OTelTracingCallback(endpoint=endpoint, protocol=protocol, **settings)
    clock = HookClock()
    clock.wrap(logger, LOGGER_METHODS)
    clock.wrap(callback, CALLBACK_HOOKS)
    trainer = toy_trainer(tmp_path, logger=logger, callbacks=[callback], max_steps=3, limit_val_batches=1)
    module = WithValidation()
    trainer.validate(module, verbose=False)
    trainer.fit(module)
    trainer.validate(module, verbose=False)
    assert trainer.global_step == 3
    assert logger.dropped > 0 and callback.dropped > 0
    assert [n for n, _ in clock.calls].count("OTLPLogger.finalize") == 3  # one flush per stage and signal
    assert [n for n, _ in clock.calls].count("OTelTracingCallback.teardown") == 3
    return clock


@pytest.fixture
def root_level():
    """Sets the root logger's level for one test (``ALIGN_LOG_LEVEL`` does the same in the CLI)."""
    root = logging.getLogger()
    saved = root.level
    yield root.setLevel
    root.setLevel(saved)


@pytest.mark.parametrize("level", ["WARNING", "ERROR"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_refusing_collector_holds_no_hook_longer_than_a_second(tmp_path, protocol, level, root_level):
    """A closed port refuses at once: every flush stops at the SDK's first retry, including the first one of the run
    (the default 10 s timeout is never waited), with the SDK's warnings switched off too."""
    root_level(level)
    clock = run_three_stages(tmp_path, endpoint_of(closed_port(), protocol), protocol)
    assert not clock.over(FAILING_WAIT + SLACK), clock.over(0.05)


def never_accepting_server() -> socket.socket:
    """Listens and never accepts: connections complete in the kernel's backlog and no byte ever comes back, as with
    a collector that hangs (or a path that drops packets once connected)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    return server


@pytest.mark.slow
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_silent_collector_holds_one_flush_up_to_the_timeout_and_the_rest_a_second(tmp_path, protocol):
    """Nothing tells a silent collector from a slow one before ``timeout``: the first flush of the run may wait that
    long; it marks the collector failing, so every later flush (either signal, later stages) waits a second at
    most."""
    timeout = 2.0
    server = never_accepting_server()
    try:
        clock = run_three_stages(tmp_path, endpoint_of(server.getsockname()[1], protocol), protocol, timeout=timeout)
    finally:
        server.close()
    assert not clock.over(timeout + SLACK), clock.over(0.05)
    long_ones = clock.over(FAILING_WAIT + SLACK)
    assert len(long_ones) <= 1 and all(name in FLUSHES for name, _ in long_ones), clock.over(0.05)
    hooks = [s for name, s in clock.calls if name not in FLUSHES]
    # No other hook waits on the network; the first setup builds the exporters, which takes ~0.1 s here.
    assert max(hooks) < FAILING_WAIT, clock.over(0.05)

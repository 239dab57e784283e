"""How long the OTLP logger and the tracing callback hold the training thread when the collector is down.

Each logger method and callback hook is wrapped to time the calls made on the training thread, over the CLI's
three stages (held-out validation, fit, validation again), and every call is checked against the bound that
docs/observability.md states. Nothing here times the whole run.
"""

import logging
import socket
import time

import pytest
from lightning.pytorch.callbacks import Callback

from align.observability import OTelTracingCallback, OTLPLogger
from align.observability.export import FAILING_WAIT

from ._toy import ToyRLModule, toy_trainer

PROTOCOLS = ["grpc", "http/protobuf"]
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


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

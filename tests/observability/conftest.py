import logging

import pytest

from .otlp_receiver import Receiver


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture(autouse=True)
def _clean_otel_env(monkeypatch):
    for key in list(__import__("os").environ):
        if key.startswith("OTEL_") or key == "ALIGN_RUN_ID":
            monkeypatch.delenv(key, raising=False)


class WarningCounter(logging.Handler):
    """Counts WARNING+ records from every logger (align's and opentelemetry's)."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def relevant(self):
        return [r for r in self.records if r.name.startswith(("align", "opentelemetry", "grpc"))]


@pytest.fixture
def warning_counter():
    handler = WarningCounter()
    root = logging.getLogger()
    root.addHandler(handler)
    yield handler
    root.removeHandler(handler)

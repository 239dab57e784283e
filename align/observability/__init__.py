"""OTLP metrics and traces (``OTLPLogger``, ``OTelTracingCallback``) and a step's timed sections (``Timer``)."""

# Importing this package (or ``align.observability.timing``) imports no opentelemetry: the logger and the callback
# are loaded on first access (docs/observability.md).

from align.observability.timing import Timer

__all__ = ["OTLPLogger", "OTelTracingCallback", "Timer"]


def __getattr__(name: str):
    if name == "OTLPLogger":
        from align.observability.logger import OTLPLogger

        return OTLPLogger
    if name == "OTelTracingCallback":
        from align.observability.tracing import OTelTracingCallback

        return OTelTracingCallback
    raise AttributeError(f"module 'align.observability' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)

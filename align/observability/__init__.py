"""OTLP metrics and traces for align runs (the only package that imports opentelemetry).

- ``OTLPLogger``: a Lightning logger exporting every logged metric over OTLP (gRPC or HTTP/protobuf).
- ``OTelTracingCallback``: a Lightning callback exporting fit -> epoch -> step spans.
- ``Timer``: times a module's section into a metrics dict, and makes it a span while the callback is active.

Importing this package (or ``align.observability.timing``) does not import opentelemetry: the logger and the
callback are loaded on first access. See docs/observability.md.
"""

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

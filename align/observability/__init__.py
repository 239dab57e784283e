"""OTLP metrics and traces for align runs (the only package that imports opentelemetry).

- ``OTLPLogger``: a Lightning logger exporting every logged metric over OTLP (gRPC or HTTP/protobuf).
- ``OTelTracingCallback``: a Lightning callback exporting fit -> epoch -> step spans.
- ``span``, ``annotate``, ``record_distribution``: what modules call; cheap no-ops when nothing is enabled.

Importing this package (or ``align.observability.spans``) does not import opentelemetry: the logger and the
callback are loaded on first access. See docs/observability.md.
"""

from align.observability.spans import annotate, record_distribution, span, tracing_enabled

__all__ = ["OTLPLogger", "OTelTracingCallback", "annotate", "record_distribution", "span", "tracing_enabled"]


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

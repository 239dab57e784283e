"""OTLP metrics and traces for align runs, and pictures of their curves (the only package that imports
opentelemetry or matplotlib).

- ``OTLPLogger``: a Lightning logger exporting every logged metric over OTLP (gRPC or HTTP/protobuf).
- ``OTelTracingCallback``: a Lightning callback exporting fit -> epoch -> step spans.
- ``Timer``: times a module's section into a metrics dict, and makes it a span while the callback is active.
- ``align.observability.plots``: ``plot_runs`` draws runs' ``metrics.csv`` into a PNG (``align plot``, and the
  ``curves.png`` of every fit).

Importing this package (or ``align.observability.timing``) imports neither opentelemetry nor matplotlib: the
logger and the callback are loaded on first access, matplotlib when a picture is drawn. See docs/observability.md.
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

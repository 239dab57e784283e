"""``OTLPLogger``: a Lightning logger that exports every logged metric over OTLP (gRPC or HTTP/protobuf).

Naming scheme: ``<prefix>.<name with "/" replaced by ".">``; ``train/kl`` -> ``align.train.kl``,
``rollout/reward_mean`` -> ``align.rollout.reward_mean``, Lightning's ``epoch`` -> ``align.epoch``; the trainer's step
is ``align.step``. Scalars are gauges (the last logged value at each export); scalars whose name matches
``histogram_metrics`` are histograms, base-2 exponential by default. Every data point carries ``align.run_id``,
``align.algorithm``, ``align.model`` and ``align.rank``; hyperparameters are flattened, redacted and exported as the
attributes of ``align.run.info`` (value 1).

The training thread does almost nothing: ``log_metrics`` stores floats, which the SDK reads on the exporter's thread
at each collection (observable gauges).
"""

from __future__ import annotations

import math
import threading
from argparse import Namespace
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.loggers.logger import Logger
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import (
    ExplicitBucketHistogramAggregation,
    ExponentialBucketHistogramAggregation,
    View,
)

from align.observability.attributes import (
    algorithm_of,
    hparam_attributes,
    matches_any,
    metric_name,
    model_name_of,
)
from align.observability.export import SCOPE, ExportPipeline
from align.observability.identity import build_resource, current_rank, default_run_id, publish_run_id
from align.observability.settings import ExportSettings, ObservabilityConfigError

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter


class OTLPLogger(Logger):
    """Exports the run's metrics over OTLP to a collector (Grafana Alloy, the OTel Collector, Jaeger, Honeycomb,
    Datadog, ...). Export runs on a background thread; a down or slow collector never slows or fails training.

    Every argument left unset is left to the OpenTelemetry SDK, which reads the standard environment variables
    (``OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT``, ``..._HEADERS``, ``..._COMPRESSION``, ...); align reads
    ``..._PROTOCOL``, ``..._TIMEOUT`` (ms) and ``OTEL_METRIC_EXPORT_INTERVAL`` (ms). The default is a local collector.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        protocol: Literal["grpc", "http/protobuf"] | None = None,
        headers: dict[str, str] | None = None,
        insecure: bool | None = None,
        compression: Literal["none", "gzip", "deflate"] | None = None,
        timeout: float | None = None,
        export_interval: float | None = None,
        certificate_file: str | None = None,
        service_name: str | None = None,
        resource_attributes: dict[str, str] | None = None,
        run_id: str | None = None,
        algorithm: str | None = None,
        model_name: str | None = None,
        prefix: str = "align",
        histogram_metrics: list[str] | None = None,
        histogram_boundaries: list[float] | None = None,
        rank_zero_only: bool = False,
    ):
        """
        Args:
            endpoint: Collector address: ``host:port`` or ``http(s)://host:port[/base]`` (HTTP adds ``/v1/metrics``).
            protocol: ``grpc`` (port 4317) or ``http/protobuf`` (port 4318).
            headers: Extra request headers, e.g. an API key for a hosted backend (never logged).
            insecure: Plain-text connection; default: true for ``http://`` endpoints, false for ``https://``.
            compression: Request compression: none, gzip or deflate.
            timeout: Seconds allowed per export; also the most that flushing at the end of a stage may take.
            export_interval: Seconds between exports (default 10).
            certificate_file: CA bundle (PEM) to verify the collector's TLS certificate.
            service_name: OTel ``service.name`` (default ``align``).
            resource_attributes: Extra resource attributes (after ``OTEL_RESOURCE_ATTRIBUTES``).
            run_id: Identifies the run across ranks and signals (default: ``ALIGN_RUN_ID`` or a new timestamped id).
            algorithm: Attribute ``align.algorithm``; default: from the LightningModule's class (``SFTModule`` -> sft).
            model_name: Attribute ``align.model``; default: the policy's model id or path.
            prefix: First component of every metric name (``align`` gives ``align.train.kl``).
            histogram_metrics: Name patterns (fnmatch, e.g. ``rollout/*_length``) of logged scalars to export as
                histograms (one sample per logged value) instead of gauges.
            histogram_boundaries: Explicit bucket boundaries for every histogram; default: base-2 exponential buckets.
            rank_zero_only: Export from global rank 0 only; by default every rank exports, each as its own service
                instance with an ``align.rank`` attribute.
        """
        super().__init__()
        self._settings = ExportSettings.resolve(
            "metrics",
            endpoint=endpoint,
            protocol=protocol,
            headers=headers,
            insecure=insecure,
            compression=compression,
            timeout=timeout,
            certificate_file=certificate_file,
        )
        source = "trainer.logger.export_interval"
        if export_interval is None:
            import os

            env = os.environ.get("OTEL_METRIC_EXPORT_INTERVAL")
            try:
                export_interval = float(env) / 1000.0 if env else 10.0
            except ValueError:
                raise ObservabilityConfigError(
                    f"OTEL_METRIC_EXPORT_INTERVAL: expected milliseconds, got {env!r}"
                ) from None
            source = "OTEL_METRIC_EXPORT_INTERVAL" if env else source
        if not export_interval > 0:
            raise ObservabilityConfigError(f"{source}: expected positive seconds, got {export_interval!r}")
        self._export_interval = float(export_interval)
        self._service_name = service_name
        self._resource_attributes = dict(resource_attributes or {})
        self._run_id = run_id or default_run_id()
        publish_run_id(self._run_id)
        self._algorithm = algorithm
        self._model_name = model_name
        self._prefix = prefix
        self._histogram_patterns = tuple(histogram_metrics or ())
        self._histogram_boundaries = list(histogram_boundaries) if histogram_boundaries else None
        self._rank_zero_only = rank_zero_only

        self._lock = threading.Lock()
        self._pipeline = ExportPipeline(self._settings)
        self._provider: MeterProvider | None = None
        self._meter: Meter | None = None
        self._attrs: dict[str, Any] = {}
        self._last: dict[str, float | None] = {}  # Lightning name (and "step") -> last logged value
        self._histograms: dict[str, Any] = {}
        self._hparams: dict[str, Any] = {}
        self._metrics_sink: Callable[[Mapping[str, float]], None] | None = None  # set by OTelTracingCallback
        self.skipped_non_finite = 0

    # ------------------------------------------------------------------ Lightning Logger API

    @property
    def name(self) -> str:
        return "otlp"

    @property
    def version(self) -> str:
        return self._run_id

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def dropped(self) -> int:
        """Metric data points that could not be delivered so far (collector down, slow or refusing)."""
        return self._pipeline.dropped

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace | None, *args: Any, **kwargs: Any) -> None:
        if isinstance(params, Namespace):
            params = vars(params)
        self._hparams.update(hparam_attributes(params))  # exported as align.run.info at each collection

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        # Lightning calls this once per stage with the LightningModule: it names the algorithm and the model.
        self._algorithm = self._algorithm or algorithm_of(model)
        self._model_name = self._model_name or model_name_of(model)
        if self._attrs:
            self._attrs = {
                **self._attrs,
                "align.algorithm": self._algorithm or "unknown",
                "align.model": self._model_name or "unknown",
            }

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        # The training thread only stores floats; the SDK reads them on the exporter's thread at collection time.
        if not self._enabled():
            return
        self._ensure_started()
        last = self._last
        for key, logged in metrics.items():
            value = _as_float(logged)
            if value is None:
                continue
            if not math.isfinite(value):
                self.skipped_non_finite += 1
                continue
            if self._histogram_patterns and matches_any(key, self._histogram_patterns):
                self._histogram(key).record(value, self._attrs)
            else:
                if key not in last:
                    self._observe(key)
                last[key] = value
        if step is not None:
            last["step"] = int(step)
        if self._metrics_sink is not None:  # the tracing callback puts them on the step span
            self._metrics_sink(metrics)

    def save(self) -> None:
        pass

    def finalize(self, status: str) -> None:
        """Flush and shut the exporter down, waiting at most ``timeout`` seconds (see ``ExportPipeline``). Lightning
        calls this at the end of every stage; logging again afterwards (the CLI validates after fit) starts anew."""
        with self._lock:
            provider, self._provider = self._provider, None
        if provider is not None:
            self._pipeline.close(lambda: provider.shutdown(timeout_millis=self._settings.timeout * 1000))

    def __getstate__(self) -> dict:
        # Picklable for spawn-based launchers: exporters and locks are rebuilt in the new process.
        state = self.__dict__.copy()
        state.update(
            _lock=None,
            _pipeline=None,
            _metrics_sink=None,
            _provider=None,
            _meter=None,
            _attrs={},
            _last={},
            _histograms={},
        )
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock, self._pipeline = threading.Lock(), ExportPipeline(self._settings)

    # ------------------------------------------------------------------ internals

    def _enabled(self) -> bool:
        return not self._rank_zero_only or current_rank() == 0

    def _ensure_started(self) -> None:
        if self._provider is not None:
            return
        with self._lock:
            if self._provider is not None:
                return
            rank = current_rank()
            resource = build_resource(
                run_id=self._run_id,
                rank=rank,
                service_name=self._service_name,
                resource_attributes=self._resource_attributes,
                algorithm=self._algorithm,
                model_name=self._model_name,
            )
            reader = PeriodicExportingMetricReader(
                self._pipeline.start(self._run_id),
                export_interval_millis=self._export_interval * 1000,
                export_timeout_millis=self._settings.timeout * 1000,
            )
            aggregation = (
                ExplicitBucketHistogramAggregation(self._histogram_boundaries)
                if self._histogram_boundaries
                else ExponentialBucketHistogramAggregation()
            )
            provider = MeterProvider(
                resource=resource,
                metric_readers=[reader],
                shutdown_on_exit=False,
                views=[View(instrument_type=Histogram, aggregation=aggregation)],
            )
            self._meter = provider.get_meter(SCOPE)
            self._attrs = {
                "align.run_id": self._run_id,
                "align.rank": rank,
                "align.algorithm": self._algorithm or "unknown",
                "align.model": self._model_name or "unknown",
            }
            self._last, self._histograms = {}, {}
            self._meter.create_observable_gauge(metric_name("step", self._prefix), callbacks=[self._collect_step])
            self._meter.create_observable_gauge(metric_name("run/info", self._prefix), callbacks=[self._collect_info])
            self._provider = provider

    def _observe(self, key: str) -> None:
        """An observable gauge reporting the last logged value of ``key``."""
        from opentelemetry.metrics import Observation

        def callback(options, key=key):
            value = self._last.get(key)
            return [] if value is None else [Observation(value, self._attrs)]

        self._last.setdefault(key, None)
        assert self._meter is not None  # log_metrics started the provider
        self._meter.create_observable_gauge(metric_name(key, self._prefix), callbacks=[callback])

    def _histogram(self, key: str):
        histogram = self._histograms.get(key)
        if histogram is None:
            assert self._meter is not None  # log_metrics started the provider
            histogram = self._histograms[key] = self._meter.create_histogram(metric_name(key, self._prefix))
        return histogram

    def _collect_step(self, options):
        from opentelemetry.metrics import Observation

        step = self._last.get("step")
        return [] if step is None else [Observation(step, self._attrs)]

    def _collect_info(self, options):
        from opentelemetry.metrics import Observation

        return [Observation(1, {**self._attrs, **self._hparams})] if self._hparams else []


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "item"):
        try:
            return float(value.item())
        except (ValueError, RuntimeError):
            return None
    return None

"""``OTelTracingCallback``: OTLP traces of where a run spends its time.

Span tree of one ``trainer.fit`` (one trace per fit; a standalone validate is its own ``validate`` trace)::

    fit                                 run id, algorithm, model, world size, hyperparameters
    ├── epoch                           align.epoch
    │   ├── step                        align.step, align.batch.size, align.batch.tokens, logged step metrics
    │   │   ├── generation / scoring / update
    │   │   │                           the RL modules' ``Timer`` sections (``align.observability.timing``)
    │   ├── checkpoint_save             from ``on_save_checkpoint`` to the end of the file write
    │   └── validation
    └── ...

Spans are exported by a ``BatchSpanProcessor`` (bounded queue, background thread); drops are counted in
``dropped`` and warned about once. Exceptions are recorded as span events with an error status.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.callbacks import Callback
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode

from align.observability import timing
from align.observability.attributes import (
    algorithm_of,
    attribute_value,
    batch_attributes,
    hparam_attributes,
    metric_name,
    model_name_of,
)
from align.observability.checkpoints import WrittenCheckpoints
from align.observability.export import SCOPE, CountingSpanProcessor, ExportPipeline
from align.observability.identity import build_resource, current_rank, default_run_id
from align.observability.settings import ExportSettings, ObservabilityConfigError

if TYPE_CHECKING:
    from lightning.pytorch import Trainer
    from opentelemetry.trace import Tracer

# Logged metrics copied onto each step span when present (names in docs/observability.md, "Metrics").
DEFAULT_STEP_METRICS = (
    "train/loss",
    "train/kl",
    "train/entropy",
    "train/policy_loss",
    "train/value_loss",
    "train/clipfrac",
    "rollout/reward_mean",
    "rollout/response_length",
    "rollout/tokens_per_s",
    "train/tokens_per_s",
)


class OTelTracingCallback(Callback):
    """Traces fit -> epoch -> step (and the modules' ``Timer`` sections, checkpoint saves and validation)
    and exports them over OTLP. Under DDP every rank exports its own spans as its own service instance
    (``service.instance.id = <run id>-rank<N>``, attribute ``align.rank``).

    Unset arguments are left to the OpenTelemetry SDK, which reads the standard ``OTEL_EXPORTER_OTLP_*`` /
    ``..._TRACES_*`` variables, ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``. With an ``OTLPLogger`` on
    the trainer both share its run id.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        protocol: Literal["grpc", "http/protobuf"] | None = None,
        headers: dict[str, str] | None = None,
        insecure: bool | None = None,
        compression: Literal["none", "gzip", "deflate"] | None = None,
        timeout: float | None = None,
        export_interval: float = 5.0,
        max_queue_size: int = 2048,
        max_export_batch_size: int = 512,
        certificate_file: str | None = None,
        service_name: str | None = None,
        resource_attributes: dict[str, str] | None = None,
        run_id: str | None = None,
        step_every_n: int = 1,
        step_metrics: list[str] | None = None,
    ):
        """
        Args:
            endpoint: Collector address: ``host:port`` or ``http(s)://host:port[/base]`` (HTTP adds ``/v1/traces``).
            protocol: ``grpc`` (port 4317) or ``http/protobuf`` (port 4318).
            headers: Extra request headers, e.g. an API key for a hosted backend (never logged).
            insecure: Plain-text connection; default: true for ``http://`` endpoints, false for ``https://``.
            compression: Request compression: none, gzip or deflate.
            timeout: Seconds allowed per export; also the most that flushing at the end of a stage may take.
            export_interval: Seconds between span batch exports.
            max_queue_size: Spans buffered for export; beyond it spans are dropped (counted, warned once).
            max_export_batch_size: Spans per export request.
            certificate_file: CA bundle (PEM) to verify the collector's TLS certificate.
            service_name: OTel ``service.name`` (default ``align``).
            resource_attributes: Extra resource attributes (after ``OTEL_RESOURCE_ATTRIBUTES``).
            run_id: Run id; default: the trainer's ``OTLPLogger`` run id, else ``ALIGN_RUN_ID``, else a new one.
            step_every_n: Trace every n-th training batch (1: every batch); the modules' sections in untraced steps
                nest under the epoch span.
            step_metrics: Logged metrics copied onto step spans when present; default: loss, KL, entropy, reward
                mean, response length and throughput names of docs/observability.md. An empty list reads none.
        """
        super().__init__()
        for name, value in (
            ("max_queue_size", max_queue_size),
            ("max_export_batch_size", max_export_batch_size),
            ("step_every_n", step_every_n),
        ):
            if not value >= 1:
                raise ObservabilityConfigError(f"trainer.callbacks.{name}: expected >= 1, got {value!r}")
        if not export_interval > 0:
            raise ObservabilityConfigError(
                f"trainer.callbacks.export_interval: expected positive seconds, got {export_interval!r}"
            )
        self._settings = ExportSettings.resolve(
            "traces",
            endpoint=endpoint,
            protocol=protocol,
            headers=headers,
            insecure=insecure,
            compression=compression,
            timeout=timeout,
            certificate_file=certificate_file,
            where="trainer.callbacks",
        )
        self._export_interval = float(export_interval)
        self._max_queue_size = int(max_queue_size)
        self._max_export_batch_size = min(int(max_export_batch_size), self._max_queue_size)
        self._service_name = service_name
        self._resource_attributes = dict(resource_attributes or {})
        self._run_id_arg = run_id
        self.run_id: str | None = run_id
        self._step_every_n = int(step_every_n)
        self._step_metrics = tuple(DEFAULT_STEP_METRICS if step_metrics is None else step_metrics)

        self._pipeline = ExportPipeline(self._settings)
        self._provider: TracerProvider | None = None
        self._tracer: Tracer | None = None
        self._root = None  # fit / validate / test / predict span
        self._epoch = None
        self._step = None
        self._step_end_ns: int | None = None
        self._step_open = False
        self._val = None
        self._ckpt = None
        self._trainer: Trainer | None = None
        self._checkpoint_write = WrittenCheckpoints(self._close_checkpoint)  # ends checkpoint_save once written
        self._logged: Mapping[str, float] | None = None
        self._has_otlp_logger = False

    @property
    def dropped(self) -> int:
        """Spans that could not be delivered so far (collector down, slow or refusing, or a full queue)."""
        return self._pipeline.dropped

    # ------------------------------------------------------------------ lifecycle

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer
        self._resolve_run_id(trainer)
        if self._provider is None:
            self._start(pl_module)
        timing._install(self)
        self._checkpoint_write.install(trainer.strategy)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._close_all()
        for lg in trainer.loggers:
            if getattr(lg, "_metrics_sink", None) == self.receive_logged_metrics:
                lg._metrics_sink = None
        self._checkpoint_write.remove()
        if timing._active is self:
            timing._install(None)
        self._shutdown()
        self._trainer = None

    def _resolve_run_id(self, trainer) -> None:
        from align.observability.logger import OTLPLogger

        otlp_loggers = [lg for lg in trainer.loggers if isinstance(lg, OTLPLogger)]
        run_id = (
            self._run_id_arg or (otlp_loggers[0].run_id if otlp_loggers else None) or self.run_id or default_run_id()
        )
        if trainer.world_size > 1:  # every rank calls setup at the same point: safe to broadcast
            run_id = trainer.strategy.broadcast(run_id, src=0)
        self.run_id = run_id
        self._has_otlp_logger = bool(otlp_loggers)
        for lg in otlp_loggers:
            if lg._provider is None and lg.run_id != run_id:
                lg._run_id = run_id
            lg._metrics_sink = self.receive_logged_metrics

    def _start(self, pl_module) -> None:
        run_id = self.run_id
        assert run_id is not None  # setup resolves it first
        rank = current_rank()
        self._algorithm, self._model_name = algorithm_of(pl_module), model_name_of(pl_module)
        resource = build_resource(
            run_id=run_id,
            rank=rank,
            service_name=self._service_name,
            resource_attributes=self._resource_attributes,
            algorithm=self._algorithm,
            model_name=self._model_name,
        )
        exporter = self._pipeline.start(run_id)
        batch = BatchSpanProcessor(
            exporter,
            max_queue_size=self._max_queue_size,
            schedule_delay_millis=self._export_interval * 1000,
            max_export_batch_size=self._max_export_batch_size,
            export_timeout_millis=self._settings.timeout * 1000,
        )
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._provider.add_span_processor(CountingSpanProcessor(batch, exporter, self._max_queue_size))
        self._tracer = self._provider.get_tracer(SCOPE)

    def _shutdown(self) -> None:
        provider, self._provider, self._tracer = self._provider, None, None
        if provider is not None:
            self._pipeline.close(provider.shutdown)

    # ------------------------------------------------------------------ span helpers

    def _start_span(self, name: str, parent, attributes: dict[str, Any] | None = None, start_time: int | None = None):
        ctx = trace.set_span_in_context(parent) if parent is not None else None
        assert self._tracer is not None  # spans are started only while tracing
        return self._tracer.start_span(name, context=ctx, attributes=attributes, start_time=start_time)

    def _parent(self):
        """The innermost open trainer span: step, validation, epoch, then the root."""
        if self._step is not None and self._step_open:
            return self._step
        return self._val or self._epoch or self._root

    def _end(self, span, end_time: int | None = None) -> None:
        if span is not None:
            span.end(end_time=end_time)

    def _close_step(self) -> None:
        """End the step span; done at the next hook so that the step's logged metrics are final."""
        step, self._step = self._step, None
        if step is None:
            return
        self._step_open = False
        logged, self._logged = self._logged, None
        if self._step_metrics and self._trainer is not None:
            try:
                if logged is None and not self._has_otlp_logger and self._is_logging_step():
                    # ``callback_metrics`` recomputes Lightning's metric dict: only on steps Lightning logs anyway.
                    logged = self._trainer.callback_metrics
                for name in self._step_metrics if logged else ():
                    value = logged.get(name)
                    if value is not None:
                        step.set_attribute(metric_name(name), float(value))
            except Exception:  # attributes are a bonus; never fail a step for them
                pass
        step.end(end_time=self._step_end_ns)

    def _is_logging_step(self) -> bool:
        assert self._trainer is not None  # asked only between setup and teardown
        every = max(int(getattr(self._trainer, "log_every_n_steps", 1) or 1), 1)
        return self._trainer.global_step % every == 0

    def receive_logged_metrics(self, metrics: Mapping[str, float]) -> None:
        """Called by an ``OTLPLogger`` of the same trainer with the floats Lightning just logged (no extra work)."""
        if self._step is not None and not self._step_open:  # between the step's end and the next hook
            self._logged = metrics

    def _close_checkpoint(self, path: str | None = None) -> None:
        ckpt, self._ckpt = self._ckpt, None
        if ckpt is not None:
            if path:
                ckpt.set_attribute("align.checkpoint.path", str(path))
            ckpt.end()

    def _close_all(self, error: BaseException | None = None) -> None:
        self._close_checkpoint()
        self._close_step()
        for attr in ("_val", "_epoch", "_root"):
            span = getattr(self, attr)
            if span is not None and error is not None:
                span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:512]))
            self._end(span)
            setattr(self, attr, None)

    # ------------------------------------------------------------------ Timer sections

    def open_span(self, name: str):
        """The span of a ``Timer`` block (``align.observability.timing``), entered: a child of the span open in this
        thread, else of the trainer's innermost open span (step, validation, epoch, fit)."""
        tracer = self._tracer
        if tracer is None:
            return None
        context = None
        if not trace.get_current_span().is_recording():
            parent = self._parent()
            context = trace.set_span_in_context(parent) if parent is not None else None
        span = tracer.start_as_current_span(name, context=context)
        span.__enter__()
        return span

    def record_span(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any]) -> None:
        """A finished span with the given bounds, a child of the span open in this thread (else of the trainer's
        innermost open span)."""
        if self._tracer is None:
            return
        current = trace.get_current_span()
        parent = current if current.is_recording() else self._parent()
        span = self._start_span(name, parent, {k: attribute_value(v) for k, v in attributes.items()}, start_ns)
        self._end(span, end_ns)

    @staticmethod
    def annotate(attributes: dict[str, Any]) -> None:
        """Attributes on the span current in this thread (a ``Timer`` block's), as OTLP attribute values."""
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({k: attribute_value(v) for k, v in attributes.items()})

    # ------------------------------------------------------------------ Lightning hooks

    def _root_attributes(self, trainer, pl_module) -> dict[str, Any]:
        attrs = {
            "align.run_id": self.run_id,
            "align.rank": current_rank(),
            "align.world_size": trainer.world_size,
            "align.algorithm": self._algorithm or "unknown",
            "align.model": self._model_name or "unknown",
        }
        if trainer.max_steps and trainer.max_steps > 0:
            attrs["align.max_steps"] = int(trainer.max_steps)
        if trainer.max_epochs is not None:
            attrs["align.max_epochs"] = int(trainer.max_epochs)
        try:
            attrs.update(hparam_attributes(dict(pl_module.hparams)))
        except Exception:
            pass
        return attrs

    def on_fit_start(self, trainer, pl_module) -> None:
        if self._tracer is not None:
            self._root = self._start_span("fit", None, self._root_attributes(trainer, pl_module))

    def on_fit_end(self, trainer, pl_module) -> None:
        self._close_all()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self._tracer is not None:
            self._close_step()
            self._end(self._epoch)
            self._epoch = self._start_span("epoch", self._root, {"align.epoch": trainer.current_epoch})

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._close_checkpoint()
        self._close_step()
        # ModelCheckpoint may still save after this hook: the epoch span ends at the next epoch or at fit end.

    def on_train_end(self, trainer, pl_module) -> None:
        self._close_checkpoint()
        self._close_step()
        self._end(self._epoch)
        self._epoch = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._tracer is None:
            return
        self._close_checkpoint()
        self._close_step()
        if batch_idx % self._step_every_n:
            return
        attrs = {"align.step": trainer.global_step, "align.batch_idx": batch_idx, "align.epoch": trainer.current_epoch}
        attrs.update(batch_attributes(batch))
        self._step = self._start_span("step", self._epoch or self._root, attrs)
        self._step_open = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._step is not None and self._step_open:
            self._step_open = False
            self._step_end_ns = time.time_ns()

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._tracer is None:
            return
        self._close_step()
        if trainer.state.fn == "fit" and self._root is not None:
            self._val = self._start_span("validation", self._epoch or self._root, {"align.step": trainer.global_step})
        else:
            self._root = self._start_span("validate", None, self._root_attributes(trainer, pl_module))

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._val is not None:
            self._end(self._val)
            self._val = None
        elif self._root is not None and trainer.state.fn != "fit":
            self._end(self._root)
            self._root = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self._tracer is None:
            return
        self._close_checkpoint()
        parent = self._val or self._epoch or self._root
        self._ckpt = self._start_span(
            "checkpoint_save", parent, {"align.step": trainer.global_step, "align.epoch": trainer.current_epoch}
        )

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        innermost = (
            self._ckpt or (self._step if self._step is not None else None) or self._val or self._epoch or self._root
        )
        if innermost is not None:
            innermost.record_exception(exception)
            innermost.set_status(Status(StatusCode.ERROR, f"{type(exception).__name__}: {exception}"[:512]))
        if self._step is not None:
            self._step_end_ns = None
            self._step_open = False
        self._close_all(error=exception)
        # Lightning skips the ``teardown`` hook after an exception: export what the run recorded now.
        self.teardown(trainer, pl_module, "fit")

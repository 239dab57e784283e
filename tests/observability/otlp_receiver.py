"""An in-process OTLP receiver for tests: gRPC (opentelemetry-proto's generated service stubs) and HTTP/protobuf
(``/v1/metrics`` and ``/v1/traces``), both on 127.0.0.1 with a free port. Decoded requests are kept in memory."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def any_value(v) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def attrs(kvs) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


@dataclass
class Point:
    metric: str
    kind: str  # gauge | sum | histogram | exponential_histogram
    value: float | None
    attributes: dict
    resource: dict
    count: int = 0
    sum: float | None = None


@dataclass
class SpanRecord:
    name: str
    span_id: str
    parent_span_id: str
    trace_id: str
    attributes: dict
    resource: dict
    events: list = field(default_factory=list)
    status_code: int = 0
    start: int = 0
    end: int = 0


class Receiver:
    def __init__(self):
        self.lock = threading.Lock()
        self.metric_requests: list[tuple[str, Any]] = []  # (transport, ExportMetricsServiceRequest)
        self.trace_requests: list[tuple[str, Any]] = []
        self.headers: list[dict] = []
        self.grpc_port = self.http_port = 0
        self._grpc = self._http = None

    # ---------------------------------------------------------------- servers

    def start(self) -> Receiver:
        receiver = self

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                receiver._add("grpc", request, None, dict(context.invocation_metadata()))
                return metrics_service_pb2.ExportMetricsServiceResponse()

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver._add("grpc", None, request, dict(context.invocation_metadata()))
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self._grpc)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                headers = {k.lower(): v for k, v in self.headers.items()}
                if self.path == "/v1/metrics":
                    req = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
                    receiver._add("http", req, None, headers)
                    resp = metrics_service_pb2.ExportMetricsServiceResponse()
                elif self.path == "/v1/traces":
                    req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                    receiver._add("http", None, req, headers)
                    resp = trace_service_pb2.ExportTraceServiceResponse()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                data = resp.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=None)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    def endpoint(self, protocol: str) -> str:
        return f"127.0.0.1:{self.grpc_port}" if protocol == "grpc" else f"http://127.0.0.1:{self.http_port}"

    def _add(self, transport, metrics, traces, headers) -> None:
        with self.lock:
            if metrics is not None:
                self.metric_requests.append((transport, metrics))
            if traces is not None:
                self.trace_requests.append((transport, traces))
            self.headers.append(headers)

    # ---------------------------------------------------------------- decoded views

    def points(self, transport: str | None = None) -> list[Point]:
        out = []
        with self.lock:
            requests = list(self.metric_requests)
        for t, req in requests:
            if transport and t != transport:
                continue
            for rm in req.resource_metrics:
                res = attrs(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        kind = m.WhichOneof("data")
                        for dp in getattr(m, kind).data_points:
                            if kind in ("gauge", "sum"):
                                value = dp.as_double if dp.WhichOneof("value") == "as_double" else dp.as_int
                                out.append(Point(m.name, kind, value, attrs(dp.attributes), res))
                            else:
                                out.append(
                                    Point(m.name, kind, None, attrs(dp.attributes), res, count=dp.count, sum=dp.sum)
                                )
        return out

    def spans(self, transport: str | None = None) -> list[SpanRecord]:
        out = []
        with self.lock:
            requests = list(self.trace_requests)
        for t, req in requests:
            if transport and t != transport:
                continue
            for rs in req.resource_spans:
                res = attrs(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append(
                            SpanRecord(
                                name=s.name,
                                span_id=s.span_id.hex(),
                                parent_span_id=s.parent_span_id.hex(),
                                trace_id=s.trace_id.hex(),
                                attributes=attrs(s.attributes),
                                resource=res,
                                events=[(e.name, attrs(e.attributes)) for e in s.events],
                                status_code=s.status.code,
                                start=s.start_time_unix_nano,
                                end=s.end_time_unix_nano,
                            )
                        )
        return out

    def wait_for(self, predicate, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.05)
        return predicate()

"""OTLP export (issue 16): a `meshlm serve` given OTEL_EXPORTER_OTLP_ENDPOINT sends its traces
and metrics to that collector, as every OpenTelemetry user expects. The collector here is a real
OTLP/HTTP receiver in the test that records what arrives."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from mesh_common.ports import free_port
from meshlm.demo.launcher import _serving
from meshlm.demo.procs import Proc, wait_until
from model_runtime.serving.client import Client

_MESSAGES = {
    "/v1/traces": (
        trace_service_pb2.ExportTraceServiceRequest,
        trace_service_pb2.ExportTraceServiceResponse,
    ),
    "/v1/metrics": (
        metrics_service_pb2.ExportMetricsServiceRequest,
        metrics_service_pb2.ExportMetricsServiceResponse,
    ),
}


class Receiver:
    """OTLP/HTTP (protobuf) on loopback: keeps every export request, decoded."""

    def __init__(self) -> None:
        self.received: dict[str, list] = {path: [] for path in _MESSAGES}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request_type, response_type = _MESSAGES[self.path]
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.received[self.path].append(request_type.FromString(body))
                reply = response_type().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def spans(self) -> list:
        return [
            span
            for req in self.received["/v1/traces"]
            for rs in req.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]

    def metric_names(self) -> set[str]:
        return {
            m.name
            for req in self.received["/v1/metrics"]
            for rm in req.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
        }


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.httpd.shutdown()
        r.httpd.server_close()


def test_serve_exports_traces_and_metrics_over_otlp(tmp_path, receiver) -> None:
    port = free_port()
    env = {
        "OMP_NUM_THREADS": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_SERVICE_NAME": "llm-v2",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    proc = Proc.meshlm("otlp", ["serve", "--port", str(port)], tmp_path, env=env).start()
    try:
        wait_until(lambda: _serving(port), 180, "runtime SERVING", proc)
        md = (("x-meshlm-tenant", "acme"),)
        with Client(f"127.0.0.1:{port}") as c:
            assert list(c.generate(prompt="Hello", max_new_tokens=3, metadata=md))
        wait_until(
            lambda: (
                any(s.name.endswith("/Generate") for s in receiver.spans())
                and {"meshlm.ttft", "meshlm.rpc.requests"} <= receiver.metric_names()
            ),
            30,
            "a Generate span and the TTFT metric at the OTLP receiver",
            proc,
        )
    finally:
        proc.stop()
    span = next(s for s in receiver.spans() if s.name.endswith("/Generate"))
    attrs = {a.key: a.value.string_value for a in span.attributes}
    assert attrs["meshlm.tenant"] == "acme"
    resource = receiver.received["/v1/traces"][0].resource_spans[0].resource
    names = [a.value.string_value for a in resource.attributes if a.key == "service.name"]
    assert names == ["llm-v2"]


def test_an_otlp_protocol_it_cannot_speak_is_refused_by_name(tmp_path) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "serve", "--port", str(free_port())],
        env={**_base_env(), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "OTEL_EXPORTER_OTLP_PROTOCOL=grpc" in r.stderr and "http/protobuf" in r.stderr


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}

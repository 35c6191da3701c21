"""The gate measurement sources against real parts: a real Envoy with `grpc_stats` in front of
two real grpcio upstreams, and a real HTTP metrics endpoint."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from model_runtime.telemetry import MetricsServer, Telemetry
from sidecar.bootstrap import static_cluster
from sidecar.envoy_process import EnvoyProcess
from sidecar.ports import free_port
from tests.rollout_upstreams import Traffic, Upstream
from xds_server.gates import (
    FAIL,
    HALT,
    MAX_BODY,
    PASS,
    EnvoyStatsSource,
    GrpcCounts,
    LatencyReading,
    MeasurementError,
    RuntimeMetricsSource,
    delta,
    evaluate,
)
from xds_server.rollout_spec import Gates

T = "type.googleapis.com/envoy.extensions."


def caller_bootstrap(listen: int, stable_port: int, canary_port: int, canary_weight: int) -> dict:
    """A caller-side Envoy like the control plane's outbound listener: weighted clusters and the
    grpc_stats filter (static here: only the measurement is under test)."""
    hcm = {
        "@type": T + "filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "outbound",
        "route_config": {"virtual_hosts": [{"name": "llm", "domains": ["*"], "routes": [{
            "match": {"prefix": "/"},
            "route": {"weighted_clusters": {"clusters": [
                {"name": "outbound|llm|v1", "weight": 100 - canary_weight},
                {"name": "outbound|llm|v2", "weight": canary_weight},
            ]}},
        }]}]},
        "http_filters": [
            {"name": "envoy.filters.http.grpc_stats", "typed_config": {
                "@type": T + "filters.http.grpc_stats.v3.FilterConfig",
                "stats_for_all_methods": True, "enable_upstream_stats": True}},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": T + "filters.http.router.v3.Router"}},
        ],
    }  # fmt: skip
    return {
        "static_resources": {
            "clusters": [
                static_cluster("outbound|llm|v1", "127.0.0.1", stable_port),
                static_cluster("outbound|llm|v2", "127.0.0.1", canary_port),
            ],
            "listeners": [
                {
                    "name": "outbound",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": hcm,
                                }
                            ]
                        }
                    ],
                }
            ],
        }
    }


def test_envoy_stats_source_counts_grpc_errors_that_5xx_misses() -> None:
    listen = free_port()
    with (
        Upstream("v1") as v1,
        Upstream("v2", fail_percent=20) as v2,
        EnvoyProcess(caller_bootstrap(listen, v1.port, v2.port, 50)) as envoy,
    ):
        canary = EnvoyStatsSource([envoy.admin_url], "outbound|llm|v2")
        stable = EnvoyStatsSource([envoy.admin_url], "outbound|llm|v1")
        before = canary.read()
        traffic = Traffic(f"127.0.0.1:{listen}")
        try:
            traffic.send(200)
        finally:
            traffic.channel.close()
        got = delta(before, canary.read())
        # Envoy saw exactly what the canary upstream served and what the client received.
        assert got.total == v2.calls
        assert got.failure == traffic.codes["UNAVAILABLE"] > 0
        assert got.by_status.get("14") == got.failure
        assert got.success == got.total - got.failure
        assert delta(None, stable.read()).total == v1.calls
        assert v1.calls + v2.calls == 200
        # ... while the 5xx counters, being HTTP-level, see nothing wrong.
        s = envoy.stats(r"cluster\.outbound\|llm\|v2\.upstream_rq_5xx")
        assert sum(s.values()) == 0
        rate = got.success_rate
        assert rate is not None and 70 < rate < 90
        verdict = evaluate(Gates(grpc_success_rate_min=99.0, min_requests=20), got, None)
        assert verdict.outcome == FAIL and "grpc-status" in verdict.reason


def test_envoy_stats_source_unreachable_sidecar_is_a_measurement_error() -> None:
    src = EnvoyStatsSource([f"http://127.0.0.1:{free_port()}"], "outbound|llm|v2", timeout=1)
    with pytest.raises(MeasurementError):
        src.read()


def test_counter_reset_after_envoy_restart_counts_from_zero() -> None:
    before = {"a": GrpcCounts(100, 99, 1, {"0": 99, "14": 1}), "b": GrpcCounts(10, 10, 0)}
    after = {"a": GrpcCounts(5, 5, 0, {"0": 5}), "b": GrpcCounts(30, 29, 1, {"14": 1})}
    d = delta(before, after)
    assert (d.total, d.success, d.failure) == (25, 24, 1)


def test_runtime_metrics_source_reads_the_real_runtime_metrics_endpoint() -> None:
    tel = Telemetry(window_s=60)
    with MetricsServer(tel) as srv:
        url = f"http://127.0.0.1:{srv.port}/metrics"
        src = RuntimeMetricsSource(url)
        assert src.read().ttft_p99 is None  # no samples yet
        for i in range(99):
            tel.record("Generate", "OK", ttft_s=0.1 + i / 1000, tpot_s=0.02)
        tel.record("Generate", "OK", ttft_s=0.95, tpot_s=0.03)
        tel.record("Generate", "UNAVAILABLE")  # failures carry no latency
        r = src.read()
        assert r.ttft_p99 == pytest.approx(0.95) and r.tpot_p99 == pytest.approx(0.03)
        assert r.samples == 100
        gates = Gates(min_requests=1, ttft_p99_max=0.8)
        ok = GrpcCounts(50, 50, 0, {"0": 50})
        v = evaluate(gates, ok, r)
        assert v.outcome == FAIL and "TTFT p99 950ms > 800ms" in v.reason
        assert evaluate(Gates(min_requests=1, ttft_p99_max=1.0), ok, r).outcome == PASS
    with pytest.raises(MeasurementError):
        src.read()  # the runtime is gone
    # A gate whose source cannot be read holds the rollout: it never passes.
    v = evaluate(gates, ok, None, latency_error="gone")
    assert v.outcome == HALT and "metrics unavailable (gone)" in v.reason


def test_no_latency_samples_halt() -> None:
    gates = Gates(min_requests=1, ttft_p99_max=0.8)
    v = evaluate(gates, GrpcCounts(50, 50, 0), LatencyReading(None, None, 0))
    assert v.outcome == HALT and "no TTFT samples" in v.reason


def test_failures_below_min_requests_fail_the_interval() -> None:
    # 5 calls that all failed are a failed interval, not "too little traffic" (issue 9).
    v = evaluate(Gates(min_requests=20), GrpcCounts(5, 0, 5, {"14": 5}), LatencyReading())
    assert v.outcome == FAIL and "5 of 5 calls to the canary failed" in v.reason
    # One failure in 3 calls: even 17 more successes would leave 95 % < 99 %.
    v = evaluate(Gates(min_requests=20), GrpcCounts(3, 2, 1, {"0": 2, "14": 1}), None)
    assert v.outcome == FAIL
    # Few calls, none failed (or only denials that are right answers): still too little.
    v = evaluate(Gates(min_requests=20), GrpcCounts(3, 3, 0, {"0": 3}), None)
    assert v.outcome == HALT and "not enough traffic (3 requests" in v.reason
    v = evaluate(Gates(min_requests=20), GrpcCounts(3, 0, 3, {"16": 3}), None)
    assert v.outcome == HALT


class _Server(ThreadingHTTPServer):
    """Loopback HTTP answering every GET with `reply(path) -> (status, headers, body)`."""

    def __init__(self, reply: Callable[[str], tuple[int, dict, bytes]]) -> None:
        self.hits: list[str] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits.append(self.path)
                status, headers, body = reply(self.path)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def __enter__(self) -> _Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


METRICS = json.dumps({"ttft_ms": {"p99": 10, "count": 500}, "tpot_ms": {"p99": 5}}).encode()


def test_sources_read_http_only_no_redirect_and_bounded(tmp_path: Path) -> None:
    # file:, ftp:, data: are never opened, even with a readable file of perfect numbers.
    good = tmp_path / "metrics.json"
    good.write_bytes(METRICS)
    for url in (good.as_uri(), "ftp://127.0.0.1/metrics", "data:,{}"):
        with pytest.raises(MeasurementError, match="only http and https"):
            RuntimeMetricsSource(url).read()
    with pytest.raises(MeasurementError, match="only http and https"):
        EnvoyStatsSource([good.as_uri()], "outbound|llm|v2").read()
    with _Server(lambda path: (200, {}, METRICS)) as target:
        assert RuntimeMetricsSource(target.url + "/metrics").read().samples == 500
        redirect = {"location": target.url + "/metrics"}
        with (
            _Server(lambda path: (302, redirect, b"")) as hop,
            pytest.raises(MeasurementError, match="not followed"),
        ):
            RuntimeMetricsSource(hop.url + "/metrics").read()
        assert target.hits == ["/metrics"]  # the redirect target was never asked
    big = b'{"pad": "' + b"x" * (MAX_BODY + 1) + b'"}'
    with (
        _Server(lambda path: (200, {}, big)) as huge,
        pytest.raises(MeasurementError, match="response over"),
    ):
        RuntimeMetricsSource(huge.url + "/metrics").read()

"""The gate measurement sources against real parts: a real Envoy with `grpc_stats` in front of
two real grpcio upstreams, and a real HTTP metrics endpoint."""

from __future__ import annotations

import pytest

from model_runtime.telemetry import MetricsServer, Telemetry
from sidecar.bootstrap import static_cluster
from sidecar.envoy_process import EnvoyProcess
from sidecar.ports import free_port
from tests.rollout_upstreams import Traffic, Upstream
from xds_server.gates import (
    FAIL,
    HALT,
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
    assert evaluate(gates, ok, None, latency_error="gone").outcome == FAIL


def test_no_latency_samples_halt() -> None:
    gates = Gates(min_requests=1, ttft_p99_max=0.8)
    v = evaluate(gates, GrpcCounts(50, 50, 0), LatencyReading(None, None, 0))
    assert v.outcome == HALT and "no TTFT samples" in v.reason


def test_min_requests_halts_even_when_everything_failed() -> None:
    v = evaluate(Gates(min_requests=20), GrpcCounts(3, 0, 3, {"14": 3}), LatencyReading())
    assert v.outcome == HALT and "not enough traffic (3 requests" in v.reason

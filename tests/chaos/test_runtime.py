"""Chaos on the real runtime (`meshlm serve --precision int4`, SmolLM2): overload far above
capacity, and one of two replicas killed mid-stream. Both runtimes load once for the module."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from mesh_common.ports import free_port
from meshlm.demo.procs import wait_until
from model_runtime.serving.client import Client
from tests.chaos.harness import Mesh, children, kill_pid, rss_mb, serving
from tests.chaos.load import Load, failures, percentile
from tests.chaos.record import record

PROMPT = [{"role": "user", "content": "Count from one to twenty."}]
RUNTIME_FLAGS = ("--max-batch", "4", "--max-queue", "4")


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory) -> Iterator[tuple[Mesh, dict[str, int]]]:
    """Two int4 runtimes (admission: 4 running + 4 queued each), started in parallel."""
    holder = Mesh(tmp_path_factory.mktemp("runtimes"), {"services": {}})
    ports = {"a": free_port(), "b": free_port()}
    try:
        for name, port in ports.items():
            holder.start_runtime(f"runtime-{name}", port, *RUNTIME_FLAGS)
        for name, port in ports.items():
            wait_until(
                lambda p=port: serving(p), 240, f"runtime {name}", holder.procs[f"runtime-{name}"]
            )
        yield holder, ports
    finally:
        holder.stop()


def _mesh(endpoints: list[int], **extra) -> dict:
    return {
        "services": {
            "llm": {
                "versions": {"v1": {"endpoints": [f"127.0.0.1:{p}" for p in endpoints]}},
                "route": {"weights": {"v1": 100}, "stream_idle_timeout": "30s"},
                **extra,
            }
        }
    }


def _generate(target: str, max_new_tokens: int, timeout: float = 60):
    client = Client(target, authority="llm")

    def call() -> int:
        n = 0
        for chunk in client.generate(messages=PROMPT, max_new_tokens=max_new_tokens,
                                     timeout=timeout):  # fmt: skip
            n += len(chunk.token_ids)
        return n

    return call


class _Sampler:
    """Peak RSS of a few processes, sampled every 100 ms on a thread."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.peak = dict.fromkeys(pids, 0.0)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for name, pid in self.pids.items():
                with contextlib.suppress(OSError):
                    self.peak[name] = max(self.peak[name], rss_mb(pid))

    def __enter__(self) -> _Sampler:
        self._run_once()
        self._t.start()
        return self

    def _run_once(self) -> None:
        for name, pid in self.pids.items():
            self.peak[name] = rss_mb(pid)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def test_overload_is_shed_promptly_memory_bounded_recovers(runtimes, tmp_path) -> None:
    t_start = time.monotonic()
    holder, ports = runtimes
    mesh = Mesh(tmp_path, _mesh([ports["b"]], circuit_breakers={"max_requests": 256}))
    try:
        mesh.start_control_plane()
        port, admin = free_port(), free_port()
        mesh.start_sidecar("caller", admin_port=admin, outbound_port=port)
        call = _generate(f"127.0.0.1:{port}", 16)
        wait_until(call, 60, "a first stream through the caller Envoy")
        envoy = children(mesh.procs["caller"].popen.pid)[0]
        runtime = holder.procs["runtime-b"].popen.pid
        before = {"runtime": rss_mb(runtime), "envoy": rss_mb(envoy)}
        high, low = 40.0, 0.5
        with _Sampler({"runtime": runtime, "envoy": envoy}) as mem:
            with Load(call, high, workers=64) as flood:
                time.sleep(8)
            drop_at = time.monotonic()
            # Recovery: the queue drains; calls at a sustainable rate succeed again.
            wait_until(lambda: _ok(call), 60, "a call succeeds after the flood")
            recovered_s = time.monotonic() - drop_at
            with Load(call, low) as calm:
                time.sleep(6)
        out = flood.snapshot()
        shed = [o for o in out if o.status == "RESOURCE_EXHAUSTED"]
        other = failures(out, ok=("OK", "RESOURCE_EXHAUSTED"))
        calm_failed = failures(calm.snapshot())
        shed_p99 = percentile([o.latency_s for o in shed], 99)
        ok_p99 = percentile([o.latency_s for o in out if o.status == "OK"], 99)
        by = flood.by_status() + calm.by_status()
        record(
            "test_overload_is_shed_promptly_memory_bounded_recovers",
            "Overload: far above capacity, then load drops",
            load=f"{flood.held()} of 16-token streams (capacity ~ a few/s), then {calm.held()}",
            faults=[
                "offered load ~10x the runtime's capacity (int4, 2-core box)",
                f"runtime admission: {' '.join(RUNTIME_FLAGS)}",
                "caller Envoy: overload manager fixed_heap 256 MiB",
            ],
            by_status=by,
            allowed_lost=len(other) + len(calm_failed),
            recovery_s=recovered_s,
            started=t_start,
            shed_RESOURCE_EXHAUSTED=len(shed),
            shed_latency_p99_ms=round(1000 * shed_p99, 1) if shed_p99 else None,
            ok_latency_p99_ms=round(1000 * ok_p99, 1) if ok_p99 else None,
            runtime_rss_mb=f"{before['runtime']:.0f} before, peak {mem.peak['runtime']:.0f}",
            envoy_rss_mb=f"{before['envoy']:.0f} before, peak {mem.peak['envoy']:.0f}",
            overload_actions=_overload_state(admin),
        )
        assert shed, "the runtime must shed load with RESOURCE_EXHAUSTED"
        assert not other, flood.by_status()
        assert not calm_failed, calm.by_status()
        assert mem.peak["runtime"] < before["runtime"] + 512  # bounded, not proportional to load
    finally:
        mesh.stop()


def _ok(call) -> bool:
    try:
        return call() > 0
    except Exception:
        return False


def _overload_state(admin: int) -> dict:
    url = f"http://127.0.0.1:{admin}/stats?format=json&filter=overload"
    with urllib.request.urlopen(url, timeout=5) as r:
        stats = json.loads(r.read())["stats"]
    return {
        s["name"]: s["value"] for s in stats if "value" in s and "scale_percent" not in s["name"]
    }


def test_runtime_killed_mid_stream_traffic_moves_to_healthy_replica(runtimes, tmp_path) -> None:
    t_start = time.monotonic()
    holder, ports = runtimes
    mesh = Mesh(
        tmp_path,
        _mesh(
            [ports["a"], ports["b"]],
            outlier_detection={
                "consecutive_gateway_failure": 1,
                "consecutive_5xx": 1,
                "interval": "1s",
                "base_ejection_time": "30s",
                "max_ejection_percent": 50,
            },
            health_check={"interval": "1s", "timeout": "1s", "unhealthy_threshold": 1},
            retry_policy={
                "retry_on": "unavailable,connect-failure,refused-stream,reset",
                "num_retries": 2,
            },
        ),
    )
    try:
        mesh.start_control_plane()
        port, admin = free_port(), free_port()
        mesh.start_sidecar("caller", admin_port=admin, outbound_port=port)
        call = _generate(f"127.0.0.1:{port}", 24)
        wait_until(call, 60, "a first stream through the caller Envoy")
        victim = f"127.0.0.1:{ports['a']}"
        wait_until(lambda: _host_health(admin, victim) == "healthy", 30, "both replicas healthy")
        with Load(call, 2.0) as load:
            time.sleep(5)
            kill_at = time.monotonic()
            kill_pid(holder.procs["runtime-a"].popen.pid)
            wait_until(lambda: _host_health(admin, victim) != "healthy", 30, "replica ejected")
            ejected_at = time.monotonic()
            time.sleep(10)
        out = load.snapshot()
        in_flight = [o for o in out if o.start < kill_at < o.end]
        cut = failures(in_flight)
        between = failures([o for o in out if kill_at <= o.start < ejected_at])
        after = failures([o for o in out if o.start >= ejected_at])
        record(
            "test_runtime_killed_mid_stream_traffic_moves_to_healthy_replica",
            "Runtime killed mid-stream (one of two replicas)",
            load=f"{load.held()} of 24-token streams via caller Envoy, 2 int4 replicas",
            faults=["replica a SIGKILLed while streaming"],
            by_status=load.by_status(),
            allowed_lost=len(after),
            recovery_s=ejected_at - kill_at,
            started=t_start,
            in_flight_at_kill=len(in_flight),
            in_flight_cut=dict(load.by_status(cut)),
            in_flight_cut_details=sorted({o.detail for o in cut}),
            new_calls_failed_before_ejection=len(between),
            ejected_by=_host_health(admin, victim),
            retries=_stat(admin, "upstream_rq_retry"),
        )
        # A stream cut after its headers: Envoy resets the downstream stream (RST_STREAM
        # INTERNAL_ERROR), which gRPC clients map to INTERNAL, not UNAVAILABLE (gRPC
        # PROTOCOL-HTTP2.md, "Errors"). What matters: it ends with an error, never a short OK.
        assert all(o.status in ("UNAVAILABLE", "INTERNAL") for o in cut), load.by_status(cut)
        assert not after, load.by_status(after)
    finally:
        mesh.stop()


def _clusters(admin: int) -> dict:
    url = f"http://127.0.0.1:{admin}/clusters?format=json"
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _host_health(admin: int, address: str) -> str:
    host, port = address.split(":")
    for c in _clusters(admin).get("cluster_statuses", []):
        for h in c.get("host_statuses", []):
            sa = h["address"]["socket_address"]
            if sa["address"] == host and sa["port_value"] == int(port):
                flags = [k for k, v in h.get("health_status", {}).items()
                         if v is True and k != "eds_health_status"]  # fmt: skip
                return ",".join(flags) or "healthy"
    return "absent"


def _stat(admin: int, suffix: str) -> int:
    url = f"http://127.0.0.1:{admin}/stats?format=json&filter=cluster\\..*{suffix}$"
    with urllib.request.urlopen(url, timeout=5) as r:
        return sum(s.get("value", 0) for s in json.loads(r.read())["stats"])

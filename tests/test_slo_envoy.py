"""The SLO loop on real Envoys: a caller sidecar, inbound sidecars with Wasm authz and the mesh-wide
rate-limit service, real gRPC replicas, and a runtime metrics endpoint whose TTFT p99 the test
sets. A breach sheds the low-priority tenant, tightens outlier detection and scales out (the new
replica serves calls through EDS); recovery undoes each in reverse order, and nothing flaps."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_xds_support import METHOD, Upstream, eventually
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.server import XdsServer
from xds_server.slo.loop import SloController, SloLoops

KEYS = {"gold": "test-gold-key-slo-1a", "free": "test-free-key-slo-2b"}
CLUSTER = "outbound|llm|v1"


class Metrics(ThreadingHTTPServer):
    """A runtime's `GET /metrics` with the TTFT p99 the test sets."""

    def __init__(self) -> None:
        self.ttft_ms = 100.0
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps({"ttft_ms": {"p99": outer.ttft_ms, "count": 50}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), H)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@dataclass
class ReplicaScaler:
    """A Scaler whose replicas are a real gRPC server behind its own inbound Envoy."""

    xds: tuple[str, int]
    running: dict[str, tuple[Upstream, EnvoyProcess]] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)

    def scale_out(self, service: str, version: str) -> str:
        up, inbound = Upstream(f"scaled-{len(self.running) + 1}"), free_port()
        boot = ads_bootstrap(
            f"scaled-{inbound}", xds_address=self.xds, service=service, version=version,
            inbound_port=inbound, local_endpoint=up.address,
        )  # fmt: skip
        envoy = EnvoyProcess(boot).start()
        envoy.wait_ready()
        endpoint = f"127.0.0.1:{inbound}"
        self.running[endpoint] = (up, envoy)
        return endpoint

    def scale_in(self, service: str, version: str, endpoint: str) -> None:
        up, envoy = self.running.pop(endpoint)
        envoy.stop()
        up.stop()
        self.stopped.append(endpoint)


@dataclass
class World:
    cp: XdsServer
    caller: EnvoyProcess
    caller_port: int
    metrics: Metrics
    scaler: ReplicaScaler

    def calls(self, tenant: str, n: int) -> Counter[str]:
        """n calls as `tenant`: answers by replica name, failures by gRPC status."""
        out: Counter[str] = Counter()
        with grpc.insecure_channel(
            f"127.0.0.1:{self.caller_port}", options=[("grpc.default_authority", "llm")]
        ) as ch:
            call = ch.unary_unary(METHOD)
            for _ in range(n):
                try:
                    out[call(b"", metadata=[("x-api-key", KEYS[tenant])], timeout=5).decode()] += 1
                except grpc.RpcError as e:
                    out[e.code().name] += 1
        return out

    def outlier(self) -> dict[str, Any]:
        dump = self.caller.config_dump("dynamic_active_clusters")
        c = next(c["cluster"] for c in dump["configs"] if c["cluster"]["name"] == CLUSTER)
        return c.get("outlier_detection", {})


@contextlib.contextmanager
def world() -> Iterator[World]:
    metrics = Metrics()
    up = Upstream("r1")
    inbound, caller_port, caller_admin = free_port(), free_port(), free_port()
    limit = {"max_tokens": 8, "tokens_per_fill": 8, "fill_interval": "1s"}
    mesh = parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {
                        "v1": {
                            "endpoints": [f"127.0.0.1:{inbound}"],
                            "metrics_urls": [f"http://127.0.0.1:{metrics.server_port}/metrics"],
                        }
                    },
                    "outlier_detection": {"consecutive_gateway_failure": 6},
                    "slo": {
                        "ttft_p99": "500ms",
                        "intervals": 2,
                        "recover_intervals": 3,
                        "min_requests": 0,
                    },
                }
            },
            "tenants": {
                "gold": {
                    "key_sha256": hash_key(KEYS["gold"]),
                    "allow": ["llm/*"],
                    "priority": "high",
                },
                "free": {
                    "key_sha256": hash_key(KEYS["free"]),
                    "allow": ["llm/*"],
                    "priority": "low",
                    "rate_limit": limit,
                },
            },
            "caller_sidecars": [{"admin_url": f"http://127.0.0.1:{caller_admin}"}],
        }
    )
    cp = build_server(mesh, debounce=0.02).start()
    xds = ("127.0.0.1", cp.grpc_port)
    scaler = ReplicaScaler(xds)
    try:
        rs = ads_bootstrap("runtime-r1", xds_address=xds, service="llm", version="v1",
                           inbound_port=inbound, local_endpoint=up.address)  # fmt: skip
        cb = ads_bootstrap(
            "caller", xds_address=xds, outbound_port=caller_port, admin_port=caller_admin
        )
        with EnvoyProcess(rs), EnvoyProcess(cb) as caller:
            w = World(cp, caller, caller_port, metrics, scaler)
            eventually(lambda: w.calls("gold", 1)["r1"] == 1, 30, "calls through the mesh")
            yield w
    finally:
        for endpoint in list(scaler.running):
            scaler.scale_in("llm", "v1", endpoint)
        cp.stop()
        up.stop()
        metrics.shutdown()


def ticks(loop: SloController, n: int) -> None:
    for _ in range(n):
        loop.tick()


def started(loop: SloController, timeout: float = 60.0) -> dict[str, Any]:
    """The loop's status once its scale-out in flight completed (a replica starts off the
    interval: the tick that decides it returns at once)."""
    return eventually(lambda: (st := loop.status())["pending"] is None and st, timeout, "started")


def test_slo_loop_sheds_tightens_scales_out_and_undoes_in_reverse() -> None:
    with world() as w:
        loop = SloController(w.cp, "llm", scaler=w.scaler)
        assert w.calls("free", 6) == Counter(r1=6)  # within its limit of 8 a second
        time.sleep(1.1)
        w.metrics.ttft_ms = 1000.0  # TTFT p99 twice the SLO
        ticks(loop, 1)
        assert loop.history == type(loop.history)()  # one breached interval: not yet

        ticks(loop, 1)  # shed: the low-priority tenant keeps a quarter of its rate
        assert [h["action"] for h in loop.history] == ["shed"]
        assert "TTFT p99 1000ms (SLO 500ms): +100% for 2 intervals" in loop.history[0]["reason"]
        free = w.calls("free", 6)
        assert free["RESOURCE_EXHAUSTED"] >= 3, free
        assert w.calls("gold", 6) == Counter(r1=6)  # the high-priority tenant is untouched

        ticks(loop, 2)  # tighten outlier detection, pushed to the caller's cluster
        # (a changed cluster warms until its endpoints are sent again: a few seconds)
        eventually(lambda: w.outlier()["consecutive_gateway_failure"] == 3, 30, "tightened")
        assert w.outlier()["max_ejection_percent"] == 50

        ticks(loop, 2)  # scale out: a new replica, added by EDS once it serves, takes calls
        status = started(loop)
        (endpoint,) = w.scaler.running
        assert status["replicas"] == [endpoint]
        eventually(lambda: w.calls("gold", 10)["scaled-1"] > 0, 20, "the new replica serves")
        ticks(loop, 4)  # nothing left to take: still breached, nothing changes
        assert len(loop.history) == 4  # apply and ready for the scale-out

        w.metrics.ttft_ms = 200.0  # the SLO holds again
        ticks(loop, 2)
        assert len(loop.history) == 4  # not yet: recovery takes 3 intervals
        ticks(loop, 1)  # scale in: out of EDS, then stopped
        assert w.scaler.stopped == [endpoint] and not w.scaler.running
        assert w.calls("gold", 10) == Counter(r1=10)
        ticks(loop, 3)
        eventually(lambda: w.outlier()["consecutive_gateway_failure"] == 6, 30, "restored")
        ticks(loop, 3)
        time.sleep(1.1)
        assert w.calls("free", 6) == Counter(r1=6)
        ticks(loop, 6)  # the SLO keeps holding: nothing else happens
        assert [(h["direction"], h["action"]) for h in loop.history] == [
            ("apply", "shed"),
            ("apply", "tighten_outlier"),
            ("apply", "scale_out"),
            ("ready", "scale_out"),
            ("undo", "scale_out"),
            ("undo", "tighten_outlier"),
            ("undo", "shed"),
        ]


def test_an_apply_does_not_undo_the_actions_in_force_and_the_admin_api_shows_them() -> None:
    with world() as w:
        loops = SloLoops(w.cp)
        loop = loops.loops["llm"]
        w.metrics.ttft_ms = 1000.0
        ticks(loop, 2)
        assert w.cp.mesh.services["llm"].slo_state.shed_tenants == ("free",)
        w.cp.apply_mesh(w.cp.mesh.with_slo_state("llm", type(loop.state)()))  # a file re-applied
        ticks(loop, 1)  # the loop puts its actions back at once
        assert w.cp.mesh.services["llm"].slo_state.shed_tenants == ("free",)
        code, body = loops.handle("GET", "/slo")
        assert code == 200 and body["llm"]["in_force"] == ["shed"]
        assert body["llm"]["history"][0]["done"] == "rate limits of free cut to a quarter"
        assert loops.handle("GET", "/slo/nope")[0] == 404

"""Semantic circuit breaking on real parts: a caller-side Envoy streams outcomes per request class
to the control plane's AccessLogService; a failing class trips and the control plane routes it
to the quarantine pool (RDS, ACK-gated); half-open probes relapse and release; a control-plane
restart keeps the quarantine; with no pool the class gets UNAVAILABLE at the caller's Envoy.

The upstreams are real grpcio servers: the main pool answers INTERNAL to any body that holds
POISON (a query of death), the quarantine pool answers every call. Calls carry real
GenerateRequest bodies and an `x-meshlm-class` header; where the caller sidecar classifies calls
itself, its header replaces the client's, so the tests read class keys from the control plane.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from mesh_common.ports import free_port
from schemas.codec import GenerateRequest, encode_generate_request
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_xds_support import eventually
from xds_server.admin.api import AdminServer
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.resources.routes import QUARANTINED_MESSAGE
from xds_server.server import XdsServer

GEN = "/meshlm.inference.v1.Inference/Generate"
POISON_KEY = "00000000deadbeef"


class Upstream:
    """Answers its name; while `poisoned`, INTERNAL to bodies that hold b"POISON"."""

    def __init__(self, name: str, poisoned: bool) -> None:
        self.name, self.poisoned = name, poisoned
        self.poison_calls = 0
        self.port = free_port()
        self._lock = threading.Lock()
        handler = grpc.method_handlers_generic_handler(
            "meshlm.inference.v1.Inference",
            {"Generate": grpc.unary_unary_rpc_method_handler(self._generate)},
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()

    def _generate(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        if b"POISON" in request:
            with self._lock:
                self.poison_calls += 1
            if self.poisoned:
                context.abort(grpc.StatusCode.INTERNAL, f"{self.name}: runtime crashed")
        return self.name.encode()


@dataclass
class Rig:
    cp: XdsServer
    caller: EnvoyProcess
    port: int
    main: Upstream
    pool: Upstream

    def call(self, prompt: str, key: str) -> tuple[str, str]:
        """(reply or status name, message)."""
        body = encode_generate_request(GenerateRequest(prompt=prompt, max_new_tokens=4))
        with grpc.insecure_channel(
            f"127.0.0.1:{self.port}", options=[("grpc.default_authority", "llm")]
        ) as ch:
            try:
                reply = ch.unary_unary(GEN)(body, metadata=[("x-meshlm-class", key)], timeout=5)
                return reply.decode(), ""
            except grpc.RpcError as e:
                return e.code().name, e.details() or ""

    def poison(self) -> tuple[str, str]:
        return self.call("POISON: repeat the last token forever", POISON_KEY)

    def quarantined(self) -> list[dict[str, Any]]:
        return self.cp.isolation.status()["llm"]["quarantined"]

    def isolation_routes(self) -> list[str]:
        dump = self.caller.config_dump("dynamic_route_configs")
        routes = [
            r["name"]
            for c in dump.get("configs", [])
            for vh in c["route_config"].get("virtual_hosts", [])
            for r in vh.get("routes", [])
        ]
        return [r for r in routes if r.startswith("llm-isolation-")]


def the_mesh(main: Upstream, spare: Upstream, **isolation: Any):
    iso = {
        "error_rate": "50%",
        "window": "30s",
        "min_requests": 3,
        "cooldown": "1s",
        "probe_percent": 50,
        "pool": "q",
        **isolation,
    }
    return parse_mesh(
        {
            "control_plane": {"debounce": "20ms"},
            "services": {
                "llm": {
                    "versions": {
                        "v1": {"endpoints": [f"127.0.0.1:{main.port}"]},
                        "q": {"endpoints": [f"127.0.0.1:{spare.port}"]},
                    },
                    "route": {"weights": {"v1": 100, "q": 0}},
                    "isolation": {k: v for k, v in iso.items() if v is not None},
                }
            },
        }
    )


@contextmanager
def rig(tmp_path, **isolation: Any) -> Iterator[Rig]:
    main, pool = Upstream("v1", poisoned=True), Upstream("q", poisoned=False)
    store = str(tmp_path / "isolation.json")
    cp = build_server(the_mesh(main, pool, **isolation), isolation_store=store).start()
    port = free_port()
    boot = ads_bootstrap("caller-0", xds_address=("127.0.0.1", cp.grpc_port), outbound_port=port)
    try:
        with EnvoyProcess(boot) as envoy:
            r = Rig(cp, envoy, port, main, pool)
            eventually(lambda: r.call("hello", "1111111111111111")[0] == "v1", what="routes")
            yield r
    finally:
        cp.stop()
        main.server.stop(0)
        pool.server.stop(0)


def _http(admin: AdminServer, method: str, path: str, token: str = "") -> tuple[int, Any]:
    req = urllib.request.Request(admin.url + path, method=method, data=b"" if token else None)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def trip(r: Rig) -> float:
    """Poison calls until the class is quarantined and every sidecar ACKed it; seconds taken."""
    t0 = time.monotonic()

    def tripped() -> bool:
        r.poison()
        q = r.quarantined()
        return bool(q and q[0]["applied"])

    eventually(tripped, timeout=20, what="the poison class quarantined and ACKed")
    return time.monotonic() - t0


def test_a_poison_class_is_quarantined_and_healthy_traffic_is_unaffected(tmp_path) -> None:
    with rig(tmp_path, cooldown="1h") as r:
        assert trip(r) < 10
        (q,) = r.quarantined()
        assert q["state"] == "open" and "grpc-status 13" in q["why"]
        assert r.isolation_routes() == [f"llm-isolation-{q['key']}"]
        before = r.main.poison_calls
        assert {r.poison()[0] for _ in range(10)} == {"q"}  # the pool serves the class
        assert r.main.poison_calls == before  # the main pool never sees it again
        healthy = [r.call(f"question {i}", f"{i:016x}")[0] for i in range(1, 21)]
        assert healthy == ["v1"] * 20
        # The admin API shows it (GET) and releases it only with the token (POST).
        admin = AdminServer(r.cp, token="t0ken").start()
        try:
            assert _http(admin, "GET", "/isolation")[1]["llm"]["quarantined"][0]["key"] == q["key"]
            release = f"/isolation/llm/{q['key']}/release"
            assert _http(admin, "POST", release, token="wrong")[0] == 401
            assert r.quarantined()
            status = subprocess.run(
                [sys.executable, "-m", "meshlm.cli", "status", "--admin", admin.url],
                capture_output=True, text=True, timeout=60, check=True,
            ).stdout  # fmt: skip
            assert f"llm  {q['key']}  open" in status and "grpc-status 13" in status
            assert _http(admin, "POST", release, token="t0ken")[0] == 200
            eventually(lambda: not r.isolation_routes(), what="the class route removed")
        finally:
            admin.stop()


def test_half_open_relapse_backs_off_then_a_healed_pool_releases(tmp_path) -> None:
    with rig(tmp_path) as r:
        trip(r)

        def relapsed() -> bool:
            r.poison()  # half-open after 1 s: half of the class probes the main pool
            q = r.quarantined()
            return bool(q and q[0]["relapses"] >= 1)

        eventually(relapsed, timeout=20, what="a relapse in half-open")
        (q,) = r.quarantined()
        assert q["state"] == "open" and q["cooldown"] == 2.0  # doubled
        r.main.poisoned = False  # the runtime got a fix

        def released() -> bool:
            r.poison()
            return not r.quarantined()

        eventually(released, timeout=30, what="release after good probes")
        eventually(lambda: not r.isolation_routes(), what="the class route removed")
        assert {r.poison()[0] for _ in range(5)} == {"v1"}


def test_a_control_plane_restart_keeps_the_quarantine(tmp_path) -> None:
    with rig(tmp_path, cooldown="1h") as r:
        trip(r)
        keys = [q["key"] for q in r.quarantined()]
        grpc_port = r.cp.grpc_port
        r.cp.stop()
        stopped = r.main.poison_calls
        assert {r.poison()[0] for _ in range(3)} == {"q"}  # Envoy keeps its routes meanwhile
        store = str(tmp_path / "isolation.json")
        r.cp = build_server(the_mesh(r.main, r.pool, cooldown="1h"), isolation_store=store)
        r.cp.start(grpc_port)
        # The new control plane's first push to the reconnecting sidecar carries the route.
        eventually(lambda: r.cp.syncz()["nodes"].get("caller-0", {}).get("connected"), what="ADS")
        for _ in range(20):
            assert r.poison()[0] == "q"
            time.sleep(0.05)
        assert r.main.poison_calls == stopped
        assert [q["key"] for q in r.quarantined()] == keys


def test_without_a_pool_the_class_gets_unavailable_fast(tmp_path) -> None:
    with rig(tmp_path, pool=None) as r:
        key = trip(r) and r.quarantined()[0]["key"]
        before = r.main.poison_calls
        t0 = time.monotonic()
        code, message = r.poison()
        assert (code, message) == ("UNAVAILABLE", QUARANTINED_MESSAGE)
        assert time.monotonic() - t0 < 1.0
        assert r.main.poison_calls == before
        assert r.call("hello", "1111111111111111")[0] == "v1"
        assert r.cp.isolation.handle("POST", f"/isolation/llm/{key}/release")[0] == 200
        eventually(lambda: r.poison()[0] == "INTERNAL" and r.main.poison_calls > before)

"""Where rollout gates read (issue 9, defect 2): only what the operator configured in the mesh
file, never what a sidecar announces over ADS; a canary with no live endpoint neither starts nor
keeps its traffic. On real processes: `meshlm xds-server`, a caller-side Envoy, real gRPC
upstreams with grpc.health.v1, and a second Envoy whose node metadata announces a fake stats
server."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from mesh_common.ports import free_port
from meshlm.cli import main
from meshlm.demo.procs import Proc, wait_until
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_rollout_controller import FakeControlPlane, FakeGrpcCounts
from tests.test_xds_support import Upstream
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.rollout.controller import RolloutController, RolloutError
from xds_server.rollout.gates.sources import Sources
from xds_server.rollout.liveness import GrpcHealthSource
from xds_server.rollout.sources import configured_sources

TOKEN = "rollout-sources-test-token-0123456789"
ROLLOUT = {"stable": "v1", "canary": "v2", "steps": [50, 100], "interval": "1s",
           "threshold": 1, "gates": {"grpc_success_rate_min": 99.0, "min_requests": 5}}  # fmt: skip


class FakeStats(ThreadingHTTPServer):
    """What a hostile local process serves: an Envoy `/stats` with thousands of perfect canary
    calls more at every read, and a runtime `/metrics` with a tiny TTFT. Counts its hits."""

    def __init__(self) -> None:
        self.hits = 0
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits += 1
                n = outer.hits * 1000
                stats = [
                    {"name": f"cluster.outbound|{s}|{v}.grpc.meshlm.Llm.Generate.{k}", "value": n}
                    for s in ("llm", "chat")
                    for v in ("v1", "v2")
                    for k in ("total", "success", "0")
                ]
                doc = {"stats": stats, "ttft_ms": {"p99": 1, "count": n}, "tpot_ms": {"p99": 1}}
                body = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@dataclass
class Plane:
    admin_url: str
    fake: FakeStats
    dead_port: int

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        req = urllib.request.Request(
            self.admin_url + path,
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def plane(tmp_path_factory) -> Iterator[Plane]:
    """`meshlm xds-server` on a mesh file with two services: `llm` whose canary runs, and `chat`
    whose canary was never started (the README's new user). Callers: one real Envoy, named in
    `caller_sidecars`. A second Envoy announces the fake stats server as a caller's
    admin and a canary runtime's metrics."""
    tmp = tmp_path_factory.mktemp("sources")
    grpc_port, admin_port, caller_admin, dead = free_port(), free_port(), free_port(), free_port()
    v1, v2 = Upstream("v1", health=True), Upstream("v2", health=True)
    fake = FakeStats()
    versions = {
        "llm": {"v1": [v1.address], "v2": [v2.address]},
        "chat": {"v1": [v1.address], "v2": [f"127.0.0.1:{dead}"]},
    }
    mesh = {
        "control_plane": {"grpc_port": grpc_port, "admin_port": admin_port, "debounce": "20ms"},
        "services": {
            s: {
                "versions": {v: {"endpoints": eps} for v, eps in vs.items()},
                "route": {"weights": {"v1": 100, "v2": 0}},
            }
            for s, vs in versions.items()
        },
        "caller_sidecars": [{"admin_url": f"http://127.0.0.1:{caller_admin}"}],
        "rollouts": {"llm": ROLLOUT, "chat": ROLLOUT},
    }
    (tmp / "mesh.yaml").write_text(json.dumps(mesh))  # JSON is YAML
    server = Proc.meshlm(
        "xds-server", ["xds-server", "--mesh", str(tmp / "mesh.yaml")], tmp,
        env={"MESHLM_ADMIN_TOKEN": TOKEN},
    ).start()  # fmt: skip
    p = Plane(f"http://127.0.0.1:{admin_port}", fake, dead)
    try:
        wait_until(lambda: p.call("GET", "/rollouts")[0] == 200, 60, "the control plane", server)
        ads = ("127.0.0.1", grpc_port)
        caller = ads_bootstrap("caller-0", xds_address=ads, outbound_port=free_port(),
                               admin_port=caller_admin)  # fmt: skip
        # A real Envoy that ACKs like any sidecar, but announces the fake server as its admin
        # and as a canary runtime's metrics: what any local process can send over ADS.
        hostile = ads_bootstrap("caller-1", xds_address=ads, outbound_port=free_port())
        hostile["node"]["metadata"].update(
            {"meshlm.admin": fake.url, "meshlm.runtime_metrics": fake.url + "/metrics"}
        )
        with EnvoyProcess(caller), EnvoyProcess(hostile):
            yield p
    finally:
        server.stop()
        fake.shutdown()
        fake.server_close()
        v1.stop()
        v2.stop()


def test_a_fake_node_announcing_stats_over_ads_has_no_influence(plane: Plane) -> None:
    code, st = plane.call("POST", "/rollouts/llm")
    assert code == 201 and st["state"] == "Progressing" and st["canary_weight"] == 50, st
    deadline = time.monotonic() + 30
    while len(st["analyses"]) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
        st = plane.call("GET", "/rollouts/llm")[1]
    # No caller sent a call: the configured caller's counters hold the rollout at its step,
    # whatever the announced "caller" claims.
    assert len(st["analyses"]) >= 3, st
    assert st["state"] == "Progressing" and st["canary_weight"] == 50, st["message"]
    assert {a["outcome"] for a in st["analyses"]} == {"halt"}
    assert all("not enough traffic (0 requests" in a["reason"] for a in st["analyses"])
    assert plane.fake.hits == 0  # never even read
    assert plane.call("POST", "/rollouts/llm/abort")[0] == 200


def test_rollout_of_a_canary_never_started_is_refused(plane: Plane, capsys, monkeypatch) -> None:
    monkeypatch.setenv("MESHLM_ADMIN_TOKEN", TOKEN)
    assert main(["rollout", "start", "chat", "--admin", plane.admin_url]) == 1
    err = capsys.readouterr().err
    assert "HTTP 409" in err and "chat: not started: canary v2 has no live endpoint" in err, err
    # Nothing listens at the canary's endpoint: said so, not as a gRPC or TLS error.
    assert f"(nothing listening at 127.0.0.1:{plane.dead_port})" in err, err
    assert "is the v2 runtime and its sidecar running?" in err
    assert "UNAVAILABLE" not in err and "Connection refused" not in err
    assert "chat" not in plane.call("GET", "/rollouts")[1]  # nothing started, no weight moved
    assert plane.fake.hits == 0


def _mesh(v1: Upstream, v2: Upstream, **extra: Any):
    return parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {
                        "v1": {"endpoints": [v1.address]},
                        "v2": {"endpoints": [v2.address]},
                    },
                    "route": {"weights": {"v1": 100, "v2": 0}},
                }
            },
            **extra,
        }
    )


def test_a_rollout_without_configured_or_readable_sources_does_not_start(tmp_path: Path) -> None:
    v1, v2 = Upstream("v1", health=True), Upstream("v2", health=True)
    try:
        dead = f"http://127.0.0.1:{free_port()}"
        for mesh, refused in (
            (_mesh(v1, v2), r"no caller-side sidecar configured.*caller_sidecars"),
            (
                _mesh(v1, v2, caller_sidecars=[{"admin_url": dead}]),
                f"counts cannot be read: {dead}",
            ),
        ):
            cp = build_server(mesh)  # never started: only its mesh is read
            c = RolloutController(
                cp, str(tmp_path / "r.json"), configured_sources(cp), autorun=False
            )
            with pytest.raises(RolloutError, match=refused):
                c.start({"service": "llm", **ROLLOUT})
            assert c.status() == {}
    finally:
        v1.stop()
        v2.stop()


def test_a_canary_that_dies_mid_rollout_is_rolled_back(tmp_path: Path) -> None:
    v2 = Upstream("v2", health=True)
    counts = FakeGrpcCounts()
    live = GrpcHealthSource([v2.address])
    c = RolloutController(
        FakeControlPlane(), str(tmp_path / "r.json"), lambda s: Sources(counts, live=live),
        autorun=False,
    )  # fmt: skip
    try:
        assert c.start({"service": "llm", **ROLLOUT})["state"] == "Progressing"
        v2.stop()  # no traffic at all: before, this only ever "halted: not enough traffic"
        c.tick("llm", force=True)
        st = c.status("llm")
        assert st["state"] == "RolledBack" and st["weights"] == {"v1": 100, "v2": 0}
        assert (
            f"canary v2 has no live endpoint (nothing listening at {v2.address})" in st["message"]
        )
    finally:
        v2.stop()

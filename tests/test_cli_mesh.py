"""`meshlm weights`, `apply` naming what it did not apply, `generate --header` and `--watch`
(issue 17, item 4), each through the real CLI against a real control plane, its admin API and a
real caller-side Envoy. The upstreams are small gRPC servers that answer Generate with their own
name, so the version a call reached shows in what `meshlm generate` prints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2_grpc

from mesh_common.ports import free_port
from model_runtime.serving.client import GENERATE
from schemas import codec
from tests.test_xds_support import eventually, sidecar
from xds_server.admin.api import AdminServer
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.rollout.api import RolloutAPI
from xds_server.rollout.controller import RolloutController
from xds_server.server import XdsServer

TOKEN = "cli-test-token"


class _Named(grpc.GenericRpcHandler):
    """Answers Generate with one chunk whose text is the server's name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method != GENERATE:
            return None

        def generate(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            yield codec.encode_token_chunk("r", 0, [1], self.name, "stop")

        return grpc.unary_stream_rpc_method_handler(generate)


@dataclass
class Rig:
    cp: XdsServer
    admin: AdminServer
    port: int  # the caller sidecar's outbound listener
    addresses: dict[str, str]

    def meshlm(self, *argv: str, token: bool = True) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "MESHLM_ADMIN_TOKEN"}
        if token:
            env["MESHLM_ADMIN_TOKEN"] = TOKEN
        return subprocess.run(
            [sys.executable, "-m", "meshlm.cli", *argv],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def generate(self, *argv: str) -> subprocess.CompletedProcess:
        target = f"127.0.0.1:{self.port}"
        return self.meshlm("generate", "--target", target, "--authority", "llm", *argv, "hi")

    def mesh_file(self, weights: dict[str, int]) -> dict:
        versions = {v: {"endpoints": [a]} for v, a in self.addresses.items()}
        return {"services": {"llm": {"versions": versions, "route": {"weights": weights}}}}


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Iterator[Rig]:
    servers = {}
    for name in ("v1", "v2"):
        s = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        s.add_generic_rpc_handlers((_Named(name),))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), s)  # live
        servers[name] = (s, s.add_insecure_port("127.0.0.1:0"))
        s.start()
    addresses = {n: f"127.0.0.1:{p}" for n, (_, p) in servers.items()}
    rig = Rig(None, None, 0, addresses)  # type: ignore[arg-type]
    cp = build_server(parse_mesh(rig.mesh_file({"v1": 100, "v2": 0})), debounce=0.01).start()
    store = str(tmp_path_factory.mktemp("rollouts") / "r.json")
    rollouts = RolloutAPI(RolloutController(cp, store, lambda *a: None, autorun=False))
    admin = AdminServer(cp, token=TOKEN, mounts={"/rollouts": rollouts.handle}).start()
    envoy, port = sidecar(cp, "caller-cli")
    try:
        with envoy:
            rig.cp, rig.admin, rig.port = cp, admin, port
            eventually(lambda: rig.generate().stdout.strip() == "v1", 30, "route to llm")
            yield rig
    finally:
        admin.stop()
        cp.stop()
        for s, _ in servers.values():
            s.stop(0)


def test_weights_moves_the_split_and_returns_once_acked(rig: Rig) -> None:
    assert rig.cp.set_weights("llm", {"v1": 100, "v2": 0}, timeout=20).ok
    r = rig.meshlm("weights", "llm", "v1=0", "v2=100", "--admin", rig.admin.url)
    assert r.returncode == 0, r.stderr
    assert "llm: v1=0 v2=100" in r.stdout and "ACKed by caller-cli" in r.stdout
    # ACKed: the sidecar routes by the new split already, no waiting.
    assert [rig.generate().stdout.strip() for _ in range(3)] == ["v2"] * 3
    assert rig.cp.mesh.services["llm"].route.weights == {"v1": 0, "v2": 100}


def test_weights_refuses_bad_input_naming_it(rig: Rig) -> None:
    url = ("--admin", rig.admin.url)
    r = rig.meshlm("weights", "llm", "v1=lots", *url)
    assert r.returncode == 2 and "'v1=lots'" in r.stderr and "VERSION=WEIGHT" in r.stderr
    r = rig.meshlm("weights", "llm", "v1=50", "v3=50", *url)
    assert r.returncode == 1 and "HTTP 400" in r.stderr and "v3" in r.stderr, r.stderr
    r = rig.meshlm("weights", "llm", "v1=50", "v2=50", *url, token=False)
    assert r.returncode == 1 and "HTTP 401" in r.stderr and "token:" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_apply_names_the_weights_it_did_not_apply(rig: Rig, tmp_path: Path) -> None:
    assert rig.cp.set_weights("llm", {"v1": 0, "v2": 100}, timeout=20).ok
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(rig.mesh_file({"v1": 80, "v2": 20})))
    r = rig.meshlm("apply", "--mesh", str(path), "--admin", rig.admin.url)
    assert r.returncode == 0, r.stderr
    assert "not applied: services.llm.route.weights (v1=80 v2=20)" in r.stdout, r.stdout
    assert "live split v1=0 v2=100 stays" in r.stdout
    assert "meshlm weights llm v1=80 v2=20" in r.stdout
    assert rig.cp.mesh.services["llm"].route.weights == {"v1": 0, "v2": 100}
    # The file agrees with the live split: nothing to say.
    path.write_text(yaml.safe_dump(rig.mesh_file({"v1": 0, "v2": 100})))
    r = rig.meshlm("apply", "--mesh", str(path), "--admin", rig.admin.url)
    assert r.returncode == 0 and "not applied" not in r.stdout, r.stdout


def test_a_change_that_changes_nothing_says_so(rig: Rig, tmp_path: Path) -> None:
    """Not "ACKed by no sidecar", which reads like a failure."""
    url = ("--admin", rig.admin.url)
    assert rig.cp.set_weights("llm", {"v1": 100, "v2": 0}, timeout=20).ok
    r = rig.meshlm("weights", "llm", "v1=100", "v2=0", *url)
    assert r.returncode == 0, r.stderr
    assert "llm: v1=100 v2=0: nothing changed" in r.stdout and "no sidecar" not in r.stdout
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(rig.mesh_file({"v1": 100, "v2": 0})))
    r = rig.meshlm("apply", "--mesh", str(path), *url)
    assert r.returncode == 0 and r.stdout.startswith("nothing changed"), r.stdout
    # A real change still names who ACKed it.
    r = rig.meshlm("weights", "llm", "v1=50", "v2=50", *url)
    assert "ACKed by caller-cli" in r.stdout and "nothing changed" not in r.stdout, r.stdout
    assert rig.cp.set_weights("llm", {"v1": 100, "v2": 0}, timeout=20).ok


def test_weights_to_a_version_that_cannot_take_traffic(rig: Rig) -> None:
    """No endpoint in the mesh at all: refused (409, as a rollout's start) unless --force. An
    endpoint where nothing answers (its sidecar stopped): set, with a warning, and `meshlm
    status` says so while it lasts."""
    doc = rig.mesh_file({"v1": 100, "v2": 0})
    versions = doc["services"]["llm"]["versions"]
    versions["v3"] = {"endpoints": []}
    versions["v4"] = {"endpoints": [f"127.0.0.1:{free_port()}"]}  # nothing listens there
    doc["services"]["llm"]["route"]["weights"] = {"v1": 100, "v2": 0, "v3": 0, "v4": 0}
    url = ("--admin", rig.admin.url)
    try:
        assert rig.cp.update_mesh(parse_mesh(doc), timeout=20).ok
        r = rig.meshlm("weights", "llm", "v1=90", "v3=10", *url)
        assert r.returncode == 1 and "HTTP 409" in r.stderr, r.stderr
        assert "traffic to llm/v3 (10 %) has nowhere to go: v3 has no endpoint" in r.stderr
        assert "--force" in r.stderr
        assert rig.cp.mesh.services["llm"].route.weights["v3"] == 0
        r = rig.meshlm("weights", "llm", "v1=90", "v3=10", "--force", *url)
        assert r.returncode == 0 and "ACKed by caller-cli" in r.stdout, r.stderr
        assert "warning: traffic to llm/v3 (10 %) has nowhere to go" in r.stderr
        r = rig.meshlm("weights", "llm", "v1=90", "v4=10", *url)
        assert r.returncode == 0 and "ACKed by caller-cli" in r.stdout, r.stderr
        assert "warning: traffic to llm/v4 (10 %) has nowhere to go: v4 has no live endpoint" in (
            r.stderr
        )
        assert "warning: traffic to llm/v1" not in r.stderr  # v1 answers its probe
        r = rig.meshlm("status", *url, token=False)
        assert r.returncode == 0 and "traffic to llm/v4 (10 %) has nowhere to go" in r.stdout
        r = rig.meshlm("weights", "llm", "v1=100", "v4=0", *url)
        assert r.returncode == 0 and not r.stderr, r.stderr
        r = rig.meshlm("status", *url, token=False)
        assert r.returncode == 0 and "nowhere to go" not in r.stdout, r.stdout
    finally:
        assert rig.cp.update_mesh(parse_mesh(rig.mesh_file({"v1": 100, "v2": 0})), timeout=20).ok


def test_generate_header_reaches_the_route(rig: Rig) -> None:
    assert rig.cp.set_weights("llm", {"v1": 100, "v2": 0}, timeout=20).ok
    assert rig.cp.set_pins("llm", "v1", "v2", timeout=20).ok
    assert rig.generate().stdout.strip() == "v1"
    r = rig.generate("--header", "x-canary:always")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "v2"
    r = rig.generate("--header", "x-canary")
    assert r.returncode == 2 and "NAME:VALUE" in r.stderr


def _watch(rig: Rig, *argv: str) -> tuple[int, str, str]:
    """Runs `meshlm ARGV --watch 0.2` for a while, then Ctrl-C (SIGINT)."""
    env = {k: v for k, v in os.environ.items() if k != "MESHLM_ADMIN_TOKEN"}
    p = subprocess.Popen(
        [sys.executable, "-m", "meshlm.cli", *argv, "--admin", rig.admin.url, "--watch", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        time.sleep(4)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=20)
    finally:
        p.kill()
    return p.returncode, out, err


def test_status_and_rollout_status_watch_redraw_until_ctrl_c(rig: Rig) -> None:
    code, out, err = _watch(rig, "status")
    assert code == 0 and "Traceback" not in err, err
    assert out.count("Ctrl-C to stop") >= 2, out
    assert out.count("caller-cli") >= 2
    code, out, err = _watch(rig, "rollout", "status")
    assert code == 0 and "Traceback" not in err, err
    assert out.count("Ctrl-C to stop") >= 2 and out.count("no rollouts") >= 2, out
    r = rig.meshlm("rollout", "pause", "llm", "--admin", rig.admin.url, "--watch")
    assert r.returncode == 2 and "--watch is for status only" in r.stderr

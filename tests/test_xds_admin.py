"""`meshlm xds-server` as a process: the admin HTTP API (token on mutations, 200/400/401/409/504
outcomes), `/debug/syncz`, `/debug/config_dump`, and `meshlm status`, with a real Envoy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from mesh_common import type_urls as t
from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_xds_support import AdsClient, Caller, eventually, sotw, upstreams

TOKEN = "test-admin-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with upstreams("v1", "v2") as ups:
        mesh = {
            "services": {
                "llm": {
                    "versions": {n: {"endpoints": [u.address]} for n, u in ups.items()},
                    "route": {"weights": {"v1": 100}},
                }
            }
        }
        path = tmp_path_factory.mktemp("mesh") / "mesh.yaml"
        path.write_text(yaml.safe_dump(mesh))
        grpc_port, admin_port = free_port(), free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshlm.cli", "xds-server", "--mesh", str(path),
             "--grpc-port", str(grpc_port), "--admin-port", str(admin_port),
             "--debounce", "20ms"],
            env={**os.environ, "MESHLM_ADMIN_TOKEN": TOKEN},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        admin = f"http://127.0.0.1:{admin_port}"
        try:
            eventually(lambda: _get(admin, "/debug/syncz"), 30, "xds-server admin up")
            port = free_port()
            b = ads_bootstrap("caller-a", xds_address=("127.0.0.1", grpc_port), outbound_port=port)
            with EnvoyProcess(b) as envoy:
                yield {"admin": admin, "grpc_port": grpc_port, "envoy": envoy, "port": port}
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=15)
            assert proc.returncode == 0, out
            assert "admin on" in out and TOKEN not in out


def test_mutations_need_the_token(server: dict) -> None:
    status, body = _post(server["admin"], "/v1/services/llm/weights", {"v1": 50, "v2": 50}, None)
    assert status == 401 and "Bearer" in body["error"]
    status, _ = _post(server["admin"], "/v1/services/llm/weights", {"v1": 50, "v2": 50}, "nope")
    assert status == 401


def test_set_weights_over_http_returns_once_acked(server: dict) -> None:
    status, body = _post(server["admin"], "/v1/services/llm/weights", {"v2": 100}, TOKEN)
    assert status == 200 and body["ok"] and body["acked"] == ["caller-a"], body
    assert Caller(server["port"]).who() == "v2"
    status, body = _post(server["admin"], "/v1/services/llm/weights", {"v1": 100}, TOKEN)
    assert status == 200, body


def test_bad_input_gets_400_naming_the_field(server: dict) -> None:
    status, body = _post(server["admin"], "/v1/services/llm/weights", {"v1": 50, "v3": 50}, TOKEN)
    assert status == 400
    assert body["error"] == "services.llm.route.weights.v3: unknown version (known: v1, v2)"
    status, body = _post(server["admin"], "/v1/services/llm/versions/v1/endpoints", {"x": 1}, TOKEN)
    assert status == 400


def test_nack_gives_409_with_the_sidecars_error(server: dict) -> None:
    c = AdsClient(server["grpc_port"], "nacker-1")
    try:
        c.send(sotw(t.ROUTE, ["outbound"]))
        first = c.recv()
        c.send(sotw(t.ROUTE, ["outbound"], first.version_info, first.nonce))
        with ThreadPoolExecutor(1) as pool:
            path = "/v1/services/llm/weights"
            reply = pool.submit(_post, server["admin"], path, {"v1": 90, "v2": 10}, TOKEN)
            pushed = c.recv()
            c.send(sotw(t.ROUTE, ["outbound"], first.version_info, pushed.nonce, "bad route"))
            status, body = reply.result(timeout=30)
        assert status == 409 and body["errors"]["nacker-1"].endswith(": bad route"), body
    finally:
        c.close()
    status, body = _post(server["admin"], "/v1/services/llm/weights", {"v1": 100}, TOKEN)
    assert status == 200, body
    assert Caller(server["port"]).who() == "v1"


def test_a_sidecar_that_never_acks_gives_504_naming_it(server: dict) -> None:
    c = AdsClient(server["grpc_port"], "silent-1")
    try:
        c.send(sotw(t.ROUTE, ["outbound"]))
        c.recv()  # and never ACK
        status, body = _post(
            server["admin"], "/v1/services/llm/weights?timeout=1", {"v1": 90, "v2": 10}, TOKEN
        )
        assert status == 504 and body["missing"] == ["silent-1"], body
        assert "caller-a" in body["acked"]
    finally:
        c.close()


def test_syncz_config_dump_and_meshlm_status(server: dict) -> None:
    syncz = _get(server["admin"], "/debug/syncz")
    assert syncz["nodes"]["caller-a"]["types"]["RDS"]["acked_version"]
    assert syncz["convergence"]["count"] >= 1
    dump = _get(server["admin"], "/debug/config_dump")
    assert any("outbound|llm|v1" in g["types"]["CDS"]["resources"] for g in dump["groups"])
    out = subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "status", "--admin", server["admin"]],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    lines = [line.split() for line in out.splitlines()]
    assert any(r[:2] == ["caller-a", "RDS"] for r in lines), out
    assert "NACK" in out or "EDS" in out


def _get(admin: str, path: str) -> dict:
    with urllib.request.urlopen(admin + path, timeout=10) as r:
        return json.loads(r.read())


def _post(admin: str, path: str, doc: dict, token: str | None) -> tuple[int, dict]:
    req = urllib.request.Request(admin + path, data=json.dumps(doc).encode(), method="POST")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())

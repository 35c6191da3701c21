"""`meshlm apply`: a changed mesh file reaches a running control plane and its sidecars (a new
tenant key works at once through the Wasm filter), keeps the live traffic split, and a bad file
is refused with the field named and nothing pushed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import yaml

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_xds_support import Caller, upstreams
from wasm_filters.policy import hash_key
from xds_server.admin.api import AdminServer
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh

TOKEN = "apply-test-token"


def _mesh(ups: dict, keys: dict[str, str]) -> dict:
    return {
        "services": {
            "llm": {
                "versions": {v: {"endpoints": [ups[v].address]} for v in ("v1", "v2")},
                "route": {"weights": {"v1": 100, "v2": 0}},
            }
        },
        "tenants": {t: {"key_sha256": hash_key(k), "allow": ["llm/*"]} for t, k in keys.items()},
    }


def _apply(admin: AdminServer, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "apply", "--mesh", str(path), "--admin", admin.url],
        env={**os.environ, "MESHLM_ADMIN_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_apply_adds_a_tenant_live_keeps_weights_and_refuses_a_bad_file(tmp_path: Path) -> None:
    with upstreams("v1", "v2") as ups:
        cp = build_server(parse_mesh(_mesh(ups, {"acme": "acme-key"})), debounce=0.02).start()
        admin = AdminServer(cp, token=TOKEN).start()
        inbound, outbound = free_port(), free_port()
        boot = ads_bootstrap(
            "llm-v2",
            xds_address=("127.0.0.1", cp.grpc_port),
            service="llm",
            version="v2",
            inbound_port=inbound,
            outbound_port=outbound,
            local_endpoint=ups["v2"].address,
        )
        try:
            with EnvoyProcess(boot):
                guarded = Caller(inbound)
                assert guarded.who((("x-api-key", "acme-key"),)) == "v2"
                try:
                    guarded.who((("x-api-key", "beta-key"),))
                    raise AssertionError("an unknown key was allowed")
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
                # The live split moved after the file was written: apply must not undo it.
                assert cp.set_weights("llm", {"v1": 0, "v2": 100}, timeout=20).ok
                path = tmp_path / "mesh.yaml"
                path.write_text(
                    yaml.safe_dump(_mesh(ups, {"acme": "acme-key", "beta": "beta-key"}))
                )
                out = _apply(admin, path)
                assert out.returncode == 0, out.stderr
                assert "ACKed by llm-v2" in out.stdout
                assert guarded.who((("x-api-key", "beta-key"),)) == "v2"
                assert cp.mesh.services["llm"].route.weights == {"v1": 0, "v2": 100}
                assert Caller(outbound).who() == "v2"

                generation = cp.syncz()["generation"]
                bad = _mesh(ups, {"acme": "acme-key"})
                bad["services"]["llm"]["route"]["weights"] = {"v1": 50, "v3": 50}
                path.write_text(yaml.safe_dump(bad))
                out = _apply(admin, path)
                assert out.returncode == 1
                assert "services.llm.route.weights.v3" in out.stderr, out.stderr
                assert cp.syncz()["generation"] == generation  # nothing staged, nothing pushed
                assert guarded.who((("x-api-key", "beta-key"),)) == "v2"
        finally:
            admin.stop()
            cp.stop()

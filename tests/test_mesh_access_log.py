"""JSON access logs on the sidecar listeners, configured by the mesh file and pushed by the
control plane to real Envoys: one line per request with the fields an operator greps for, and
never the API key. By default the caller sidecar logs every call and the inbound sidecar the
failed and denied ones (issue 19: a line per hop per call costs every hop its formatting)."""

from __future__ import annotations

import grpc
import pytest

from tests.test_mesh_support import ACME_KEY, GEN, json_lines, two_hops
from tests.test_xds_support import eventually
from xds_server.mesh import MeshError, load_yaml, parse_mesh

SERVICES = {"llm": {"versions": {"v1": {"endpoints": ["127.0.0.1:1"]}}}}


def test_mesh_file_access_log_options() -> None:
    assert parse_mesh({"services": SERVICES}).access_log.enabled  # on by default, to stdout
    assert parse_mesh({"services": SERVICES}).access_log.path is None
    default = parse_mesh({"services": SERVICES}).access_log
    assert (default.outbound, default.inbound) == ("all", "failures")
    every = parse_mesh({"services": SERVICES, "access_log": {"inbound": "all", "outbound": "off"}})
    assert (every.access_log.outbound, every.access_log.inbound) == ("off", "all")
    with pytest.raises(MeshError, match=r"access_log.inbound: expected one of all, failures, off"):
        parse_mesh({"services": SERVICES, "access_log": {"inbound": "errors"}})
    assert not parse_mesh({"services": SERVICES, "access_log": False}).access_log.enabled
    assert parse_mesh({"services": SERVICES, "access_log": {"path": "/tmp/a.log"}}).access_log.path
    with pytest.raises(MeshError, match=r"access_log.format: unknown field"):
        parse_mesh({"services": SERVICES, "access_log": {"format": "x"}})
    with pytest.raises(MeshError, match=r"access_log.path: expected a file path"):
        parse_mesh({"services": SERVICES, "access_log": {"path": 3}})


def test_a_bare_off_in_the_mesh_file_turns_a_side_off() -> None:
    # YAML 1.1 reads an unquoted `off` as false: the README writes `inbound: off`.
    text = "services: {llm: {versions: {v1: {endpoints: ['127.0.0.1:1']}}}}\n"
    mesh = parse_mesh(load_yaml(text + "access_log: {inbound: off, outbound: off}\n"))
    assert (mesh.access_log.outbound, mesh.access_log.inbound) == ("off", "off")


def _by_listener(lines: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for line in lines:
        out.setdefault(line["listener"], []).append(line)
    return out


def test_by_default_the_inbound_sidecar_logs_only_failed_calls(tmp_path) -> None:
    path = tmp_path / "access.log"
    with two_hops(access_log={"path": str(path)}) as mesh:
        eventually(lambda: mesh.call([("x-api-key", ACME_KEY)]), what="a call through both")
        for _ in range(3):
            mesh.call([("x-api-key", ACME_KEY)])
        with pytest.raises(grpc.RpcError):
            mesh.call([("x-api-key", "wrong-key")])

        def denial_logged_by_both() -> list[dict]:
            # The denied call is the last: each sidecar writes its lines in order.
            lines = json_lines(path.read_text()) if path.exists() else []
            return lines if [x["grpc_status"] for x in lines].count(16) == 2 else []

        lines = _by_listener(eventually(denial_logged_by_both, what="the denial logged twice"))
    assert [line["grpc_status"] for line in lines["inbound|llm|v1"]] == [16]
    assert lines["inbound|llm|v1"][0]["tenant"] is None
    outbound = [line["grpc_status"] for line in lines["outbound"]]
    assert outbound[-4:] == [0, 0, 0, 16]


def test_one_json_line_per_hop_without_the_api_key(tmp_path) -> None:
    path = tmp_path / "access.log"
    with two_hops(access_log={"path": str(path), "inbound": "all"}) as mesh:
        md = [("x-api-key", ACME_KEY), ("authorization", f"Bearer {ACME_KEY}")]
        echoed = eventually(lambda: mesh.call(md), what="a call through both sidecars")
        assert echoed["x-meshlm-tenant"] == "acme"
        # A denied call that claims a tenant: logged with no tenant, not the claimed one.
        with pytest.raises(grpc.RpcError) as denied:
            mesh.call([("x-api-key", "wrong-key"), ("x-meshlm-tenant", "acme")])
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED

        def two_calls_logged() -> list[dict]:
            lines = json_lines(path.read_text()) if path.exists() else []
            return lines if len(lines) >= 4 else []

        lines = eventually(two_calls_logged, what="4 access-log lines (2 calls x 2 hops)")
    text = path.read_text()
    assert ACME_KEY not in text and "wrong-key" not in text and "Bearer" not in text
    by_listener = _by_listener(lines)
    assert set(by_listener) == {"outbound", "inbound|llm|v1"}
    ok_in, denied_in = by_listener["inbound|llm|v1"]
    assert ok_in["method"] == "POST" and ok_in["path"] == GEN
    assert ok_in["response_code"] == 200 and ok_in["grpc_status"] == 0
    assert ok_in["upstream_cluster"] == "inbound|llm|v1"
    assert ok_in["tenant"] == "acme"
    assert isinstance(ok_in["duration_ms"], int)
    assert ok_in["response_flags"] == "-"
    assert denied_in["grpc_status"] == 16 and denied_in["tenant"] is None
    ok_out = by_listener["outbound"][0]
    assert ok_out["upstream_cluster"] == "outbound|llm|v1" and ok_out["grpc_status"] == 0
    assert "tenant" not in ok_out  # unverified on the caller side: not logged

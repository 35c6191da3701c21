"""CSDS on the control plane's ADS port (issue 16 item 3), read with grpcio and the xds-protos
stubs, with a real Envoy sidecar connected: SYNCED/ACKED, a NACKed push shown as ERROR/NACKED
with Envoy's error, node matchers, and `meshlm status --csds`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from envoy.admin.v3 import config_dump_shared_pb2 as cd
from envoy.service.status.v3 import csds_pb2, csds_pb2_grpc
from envoy.type.matcher.v3 import node_pb2, string_pb2, struct_pb2

from mesh_common import type_urls as t
from sidecar.envoy_process import EnvoyProcess
from tests import test_ads_mtls as mtls
from tests.test_ads_mtls import _channel as mtls_channel
from tests.test_ads_mtls import _mesh as mtls_mesh
from tests.test_xds_authz import TENANTS, _inbound
from tests.test_xds_support import (
    AdsClient,
    eventually,
    llm_mesh,
    sidecar,
    sotw,
    upstreams,
    with_unvalidated_endpoint,
)
from xds_server.compose import build_server
from xds_server.identity import ca as ca_mod
from xds_server.mesh import parse_mesh

SYNCED, ERROR = csds_pb2.ConfigStatus.SYNCED, csds_pb2.ConfigStatus.ERROR


@pytest.fixture(scope="module")
def mesh_env() -> Iterator[dict]:
    with upstreams("v1", "v2") as ups:
        cp = build_server(llm_mesh(ups), debounce=0.05).start()
        envoy, _ = sidecar(cp, "caller-1")
        channel = grpc.insecure_channel(f"127.0.0.1:{cp.grpc_port}")
        try:
            with envoy:
                yield {"cp": cp, "csds": csds_pb2_grpc.ClientStatusDiscoveryServiceStub(channel)}
        finally:
            channel.close()
            cp.stop()


def _by_type(config: csds_pb2.ClientConfig) -> dict[str, list]:
    out: dict[str, list] = {}
    for g in config.generic_xds_configs:
        out.setdefault(g.type_url, []).append(g)
    return out


def _synced(stub: csds_pb2_grpc.ClientStatusDiscoveryServiceStub) -> csds_pb2.ClientConfig:
    def check() -> csds_pb2.ClientConfig | None:
        resp = stub.FetchClientStatus(csds_pb2.ClientStatusRequest(), timeout=5)
        if len(resp.config) != 1:
            return None
        types = _by_type(resp.config[0])
        gs = [g for gs in types.values() for g in gs]
        ok = {t.LISTENER, t.CLUSTER, t.ROUTE, t.ENDPOINT} <= set(types) and all(
            g.config_status == SYNCED and g.client_status == cd.ACKED for g in gs
        )
        return resp.config[0] if ok else None

    return eventually(check, what="caller-1 SYNCED and ACKED for every resource")


def test_csds_shows_a_connected_envoy_synced_and_acked(mesh_env: dict) -> None:
    cp, stub = mesh_env["cp"], mesh_env["csds"]
    config = _synced(stub)
    assert config.node.id == "caller-1"
    clusters = _by_type(config)[t.CLUSTER]
    assert {g.version_info for g in clusters} == {
        cp.syncz()["nodes"]["caller-1"]["types"]["CDS"]["acked_version"]
    }
    assert all(g.xds_config.type_url == t.CLUSTER for g in clusters)
    assert all(g.last_updated.seconds > 0 for g in clusters)
    bare = stub.FetchClientStatus(
        csds_pb2.ClientStatusRequest(exclude_resource_contents=True), timeout=5
    )
    assert not any(g.HasField("xds_config") for g in bare.config[0].generic_xds_configs)


def test_csds_shows_a_nacked_push_with_envoys_error(mesh_env: dict) -> None:
    cp, stub = mesh_env["cp"], mesh_env["csds"]
    good = cp.mesh
    _synced(stub)
    # Envoy's EDS takes IP addresses only: a host name is NACKed.
    bad = cp.update_mesh(
        with_unvalidated_endpoint(good, "v1", "llm-host.invalid", 50051), timeout=20
    )
    assert not bad.ok
    try:
        resp = stub.FetchClientStatus(csds_pb2.ClientStatusRequest(), timeout=5)
        types = _by_type(resp.config[0])
        nacked = [g for g in types[t.ENDPOINT] if g.client_status == cd.NACKED]
        assert nacked, types[t.ENDPOINT]
        for g in nacked:
            assert g.config_status == ERROR
            assert g.error_state.version_info == bad.version
            assert "malformed IP address" in g.error_state.details
        assert all(g.config_status == SYNCED for g in types[t.LISTENER])
    finally:
        assert cp.update_mesh(good, timeout=20).ok
    _synced(stub)  # the fix is ACKed: no NACK shown any more


def test_csds_node_matchers_and_stream(mesh_env: dict) -> None:
    stub = mesh_env["csds"]
    _synced(stub)

    def req(**match: str) -> csds_pb2.ClientStatusRequest:
        m = node_pb2.NodeMatcher(node_id=string_pb2.StringMatcher(**match))
        return csds_pb2.ClientStatusRequest(node_matchers=[m], exclude_resource_contents=True)

    answers = list(stub.StreamClientStatus(iter([req(exact="caller-1"), req(prefix="nobody")])))
    assert [[c.node.id for c in a.config] for a in answers] == [["caller-1"], []]
    bad = csds_pb2.ClientStatusRequest(
        node_matchers=[node_pb2.NodeMatcher(node_metadatas=[struct_pb2.StructMatcher()])]
    )
    with pytest.raises(grpc.RpcError) as e:
        stub.FetchClientStatus(bad, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "node_matchers[0].node_metadatas" in e.value.details()


def test_meshlm_status_reads_csds(mesh_env: dict) -> None:
    cp, stub = mesh_env["cp"], mesh_env["csds"]
    _synced(stub)
    out = subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "status", "--csds", f"127.0.0.1:{cp.grpc_port}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["NODE", "TYPE", "RESOURCES", "VERSION", "STATUS", "ERROR"]
    rows = {tuple(line.split()[:2]): line.split() for line in lines[1:]}
    assert rows[("caller-1", "CDS")][4] == "SYNCED/ACKED"
    assert rows[("caller-1", "LDS")][4] == "SYNCED/ACKED"
    down = subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "status", "--csds", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert down.returncode == 1 and "meshlm status: CSDS 127.0.0.1:1:" in down.stderr


def test_csds_never_shows_native_authz_keys(tmp_path) -> None:
    """Native authz pushes plaintext keys to Envoy; CSDS (any mesh certificate reads it) shows
    them redacted, as the admin API's config dump does."""
    keys = tmp_path / "keys.yaml"
    keys.write_text("acme: demo-acme-key\nfree: demo-free-key\n")
    keys.chmod(0o600)
    with upstreams("runtime") as ups:
        raw = {
            "services": {"llm": {"versions": {"v1": {"endpoints": [ups["runtime"].address]}}}},
            "tenants": TENANTS,
            "authz": {"mode": "native", "keys_file": str(keys)},
        }
        cp = build_server(parse_mesh(raw), debounce=0.02).start()
        boot, _ = _inbound(cp, "native-1", ups["runtime"].address)
        try:
            with EnvoyProcess(boot), grpc.insecure_channel(f"127.0.0.1:{cp.grpc_port}") as ch:
                stub = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(ch)
                _synced(stub)
                text = str(stub.FetchClientStatus(csds_pb2.ClientStatusRequest(), timeout=5))
        finally:
            cp.stop()
    assert "demo-acme-key" not in text and "demo-free-key" not in text
    assert "[redacted]" in text


def test_meshlm_status_reads_csds_over_mtls_with_a_mesh_certificate(tmp_path) -> None:
    """With identity the ADS port (and CSDS on it) takes mesh certificates only: `meshlm status
    --csds` presents one (--cert/--key, --cacert the mesh roots); without it, a clear error."""
    with upstreams("v1") as ups:
        cp = build_server(mtls_mesh(ups["v1"].address), debounce=0.02).start()
        try:
            sidecar_ch = mtls_channel(cp, mtls.CALLER)
            client = AdsClient(cp.grpc_port, "caller-m", channel=sidecar_ch, auto_ack=True)
            client.send(sotw(t.CLUSTER))
            eventually(lambda: cp.syncz()["nodes"]["caller-m"]["types"]["CDS"]["acked_version"])
            key = ca_mod.new_key()
            csr = (
                x509.CertificateSigningRequestBuilder()
                .subject_name(x509.Name([]))
                .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(
                    mtls.CALLER)]), True)
                .sign(key, hashes.SHA256())
            )  # fmt: skip
            (tmp_path / "cert.pem").write_text("".join(cp.identity.ca.sign(csr, mtls.CALLER, 600)))
            (tmp_path / "key.pem").write_bytes(ca_mod.key_pem(key))
            (tmp_path / "ca.pem").write_bytes(cp.identity.ca.bundle_pem())
            target = f"127.0.0.1:{cp.grpc_port}"
            files = ["--cert", str(tmp_path / "cert.pem"), "--key", str(tmp_path / "key.pem"),
                     "--cacert", str(tmp_path / "ca.pem")]  # fmt: skip
            base = [sys.executable, "-m", "meshlm.cli", "status", "--csds", target]
            run = dict(capture_output=True, text=True, timeout=30)
            ok = subprocess.run([*base, *files], **run)
            assert ok.returncode == 0, ok.stderr
            assert any(line.split()[:2] == ["caller-m", "CDS"] for line in ok.stdout.splitlines())
            assert "SYNCED/ACKED" in ok.stdout
            plain = subprocess.run(base, **run)
            assert plain.returncode == 1 and f"CSDS {target}: UNAVAILABLE" in plain.stderr
            half = subprocess.run([*base, "--cert", str(tmp_path / "cert.pem")], **run)
            assert half.returncode == 1 and "--cert, --key and --cacert go together" in half.stderr
            client.close()
        finally:
            cp.stop()

"""ADS over mTLS (issue 14): with identity on, the control plane's ADS port takes only clients
with a certificate of the mesh CA, learns each sidecar's SPIFFE ID from it, and believes node
metadata only as far as that identity goes. Real control plane, CA, agents and Envoy."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from mesh_common import type_urls as t
from mesh_common.ports import free_port
from meshlm.commands import status as cmd_status
from sidecar import bootstrap
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from sidecar.identity import IdentityAgent
from sidecar.supervisor import Supervisor
from tests.test_identity_support import join_token_file, short_dir
from tests.test_xds_support import AdsClient, eventually, sotw, upstreams
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.identity import ca as ca_mod
from xds_server.mesh import Mesh, parse_mesh
from xds_server.ratelimit import shares as membership
from xds_server.ratelimit.service import DOMAIN
from xds_server.server import XdsServer

TD = "meshlm.local"
CALLER = f"spiffe://{TD}/ns/default/sa/caller"
LLM = f"spiffe://{TD}/ns/default/sa/llm"  # the llm service's account (the default one)


def _mesh(upstream: str, service_account: str = "default/llm", **control_plane: int) -> Mesh:
    return parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {"v1": {"endpoints": [upstream]}},
                    "route": {"weights": {"v1": 100}},
                    "service_account": service_account,
                }
            },
            "identity": {"trust_domain": TD},
            "control_plane": control_plane,
        }
    )


def _inbound(port: int) -> dict:
    return {
        "meshlm.service": "llm",
        "meshlm.version": "v1",
        "meshlm.inbound_port": port,
        "meshlm.local_endpoint": "127.0.0.1:1",
    }


def _channel(cp: XdsServer, identity: str, signer: ca_mod.MeshCA | None = None) -> grpc.Channel:
    """A TLS channel to `cp`'s ADS port with a client certificate for `identity` signed by
    `signer` (default: the mesh CA), trusting the mesh's roots."""
    key = ca_mod.new_key()
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity)]), True
        )
        .sign(key, hashes.SHA256())
    )
    chain = (signer or cp.identity.ca).sign(csr, identity, 600)
    creds = grpc.ssl_channel_credentials(
        cp.identity.ca.bundle_pem(), ca_mod.key_pem(key), "".join(chain).encode()
    )
    return grpc.secure_channel(
        f"127.0.0.1:{cp.grpc_port}",
        creds,
        options=[("grpc.ssl_target_name_override", ca_mod.CA_SERVER_NAME)],
    )


def _client(cp: XdsServer, node_id: str, channel: grpc.Channel, **kw) -> AdsClient:
    c = AdsClient(cp.grpc_port, node_id, channel=channel, **kw)
    c.send(sotw(t.CLUSTER))
    return c


def _supervisor(
    cp_port: int, node_id: str, d: Path, agent: IdentityAgent | None, events: list, **where
):
    """A supervised Envoy, a caller sidecar unless `where` says otherwise (ads_bootstrap)."""
    boot = ads_bootstrap(
        node_id,
        xds_address=("127.0.0.1", cp_port),
        admin_port=free_port(),
        **(where or {"outbound_port": free_port()}),
    )
    return Supervisor(
        node_id,
        boot,
        ("127.0.0.1", cp_port),
        poll_interval=0.2,
        on_event=events.append,
        identity=agent,
    )


def _verified(cp: XdsServer, node_id: str) -> str:
    """The SPIFFE ID /debug/syncz shows for a connected node that ACKed its listeners."""
    node = cp.syncz()["nodes"].get(node_id)
    if not node or not node["connected"] or not node["types"].get("LDS", {}).get("acked_version"):
        return ""
    return node["spiffe_id"]


@pytest.fixture
def cp():
    with (
        upstreams("v1") as ups,
        build_server(_mesh(ups["v1"].address), debounce=0.02) as cp,
    ):
        yield cp


def test_sidecar_with_identity_gets_its_config_over_mtls_and_survives_a_restart() -> None:
    d = short_dir()
    events: list[str] = []
    with upstreams("v1") as ups:
        # CA ports of its own (by default a restart on a fixed ADS port takes the next two).
        mesh = _mesh(ups["v1"].address, ca_port=free_port(), ca_mtls_port=free_port())
        first = build_server(mesh, debounce=0.02, identity_dir=str(d / "cp")).start()
        port = first.grpc_port
        agent = IdentityAgent(d / "sc", join_token_file=join_token_file(first, "default/caller", d))
        sv = _supervisor(port, "caller-a", d, agent, events)
        sv.start()
        second = None
        try:
            sv.wait_ready()
            assert eventually(lambda: _verified(first, "caller-a"), what="ACKs") == CALLER
            stats = sv.envoy.stats(r"^cluster\.xds_cluster\.ssl\.handshake$")
            assert stats["cluster.xds_cluster.ssl.handshake"] >= 1, "ADS went over TLS"
            first.stop()
            # Same port, same CA state: the same Envoy reconnects and ACKs again.
            second = build_server(mesh, debounce=0.02, identity_dir=str(d / "cp")).start(port)
            assert eventually(lambda: _verified(second, "caller-a"), what="back") == CALLER
            assert sv.failed is None and sv.envoy.proc.poll() is None
        finally:
            sv.stop()
            first.stop()
            if second:
                second.stop()
    assert not any("giving up" in e for e in events), events


def test_plaintext_clients_are_refused(cp) -> None:
    plain = AdsClient(cp.grpc_port, "plain")
    plain.send(sotw(t.CLUSTER))
    try:
        assert plain.closed_with()[0] == grpc.StatusCode.UNAVAILABLE
    finally:
        plain.close()
    # A real Envoy without identity never gets a stream in.
    boot = ads_bootstrap("plain-envoy", xds_address=("127.0.0.1", cp.grpc_port), outbound_port=1)
    envoy = EnvoyProcess(boot).start()  # never LIVE: its first CDS fetch gets nowhere
    try:
        name = "cluster.xds_cluster.upstream_cx_total"
        eventually(lambda: envoy.stats(f"^{name}$").get(name, 0) >= 2, what="Envoy retried")
        # control_plane.connected_state is 1 for a moment at each attempt (Envoy counts a stream
        # as connected once it is opened, before the handshake fails), so it is no proof either
        # way: what holds is that no config ever came in.
        cds = "cluster_manager.cds.update_success"
        assert envoy.stats(f"^{cds}$").get(cds) == 0
    finally:
        envoy.stop()
    assert "plain-envoy" not in cp.syncz()["nodes"]


def test_sidecar_and_control_plane_disagreeing_on_mtls_fail_with_a_clear_message(cp) -> None:
    d = short_dir()
    # No identity, a control plane that requires mTLS.
    sv = _supervisor(cp.grpc_port, "no-id", d, None, [])
    sv.start()
    try:
        failed = eventually(lambda: sv.failed, what="the supervisor gave up")
    finally:
        sv.stop()
    assert "requires mTLS" in failed and "--identity" in failed
    # Identity, a control plane (no identity block) that serves ADS in plaintext.
    token = join_token_file(cp, "default/caller", d)
    with upstreams("v1") as ups, build_server(_plain(ups["v1"].address)) as plain_cp:
        sv = _supervisor(
            plain_cp.grpc_port, "with-id", d, IdentityAgent(d / "sc", join_token_file=token), []
        )
        sv.start()
        try:
            failed = eventually(lambda: sv.failed, what="the supervisor gave up")
        finally:
            sv.stop()
    assert "plaintext" in failed and "--identity" in failed


def _plain(upstream: str) -> Mesh:
    return parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {"v1": {"endpoints": [upstream]}},
                    "route": {"weights": {"v1": 100}},
                }
            }
        }
    )


def test_mesh_certificate_is_taken_and_one_of_a_rogue_ca_refused(cp) -> None:
    ok = _client(cp, "caller-ok", _channel(cp, CALLER))
    rogue = _client(cp, "caller-rogue", _channel(cp, CALLER, signer=ca_mod.MeshCA(TD)))
    try:
        assert ok.recv().type_url == t.CLUSTER
        assert rogue.closed_with()[0] == grpc.StatusCode.UNAVAILABLE  # the handshake fails
        assert eventually(lambda: cp.syncz()["nodes"]["caller-ok"]["spiffe_id"]) == CALLER
        assert f"caller-ok {CALLER}" in cmd_status.render(cp.syncz())  # meshlm status
        assert "caller-rogue" not in cp.syncz()["nodes"]
    finally:
        ok.close()
        rogue.close()


def test_ads_port_takes_a_rotated_root_at_once(cp) -> None:
    cp.identity.ca.rotate_root(activate_after=0, overlap=600)

    # Signed by the new root only: taken once the ADS server serves the new trust bundle.
    def connects() -> bool:
        c = _client(cp, "caller-new-root", _channel(cp, CALLER))
        try:
            return c.recv(timeout=2).type_url == t.CLUSTER
        finally:
            c.close()

    assert eventually(connects, what="a certificate of the new root taken")


def test_inbound_sidecar_claiming_another_services_metadata_is_refused(cp, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    d = short_dir()
    # A real sidecar whose certificate is a caller's, announcing an inbound listener of llm.
    agent = IdentityAgent(d / "sc", join_token_file=join_token_file(cp, "default/caller", d))
    inbound = {k.removeprefix("meshlm."): v for k, v in _inbound(free_port()).items()}
    envoy = _supervisor(cp.grpc_port, "llm-v1-envoy-fake", d, agent, [], **inbound).start()
    fake = _client(cp, "llm-v1-fake", _channel(cp, CALLER), metadata=_inbound(15100))
    real = _client(cp, "llm-v1-real", _channel(cp, LLM), metadata=_inbound(15101))
    try:
        code, details = fake.closed_with()
        assert code == grpc.StatusCode.PERMISSION_DENIED
        for part in ("llm-v1-fake", "'llm'", CALLER):
            assert part in details and part in caplog.text
        assert real.recv().type_url == t.CLUSTER
        eventually(lambda: "llm-v1-real" in cp.syncz()["nodes"], what="real one admitted")
        assert membership.inbound_sidecars(cp.sync)["llm"] == 1  # the fake one not counted
        assert cp.syncz()["nodes"]["llm-v1-real"]["spiffe_id"] == LLM
        rejected = cp.syncz()["rejected"]
        assert [r["code"] for r in rejected if r["node_id"] == "llm-v1-fake"] == [
            "PERMISSION_DENIED"
        ]
        eventually(
            lambda: any(r["node_id"] == "llm-v1-envoy-fake" for r in cp.syncz()["rejected"]),
            what="the Envoy impostor refused",
        )
        rejected = cp.syncz()["rejected"]
        assert {r["code"] for r in rejected if r["node_id"] == "llm-v1-envoy-fake"} == {
            "PERMISSION_DENIED"
        }
        assert "llm-v1-envoy-fake" not in cp.syncz()["nodes"]
        assert membership.inbound_sidecars(cp.sync)["llm"] == 1
        # The service gets another account: the old one's sidecar is no longer believed.
        upstream = str(cp.mesh.services["llm"].versions["v1"].endpoints[0])
        cp.update_mesh(_mesh(upstream, service_account="default/llm2"), timeout=0)
        assert real.closed_with()[0] == grpc.StatusCode.PERMISSION_DENIED
        eventually(lambda: membership.inbound_sidecars(cp.sync)["llm"] == 0, what="uncounted")
    finally:
        fake.close()
        real.close()
        if envoy.envoy:  # never LIVE (its first fetch is refused): no wait for its timeout
            envoy.envoy.kill()
        envoy.stop()


def test_sidecar_knows_the_control_planes_service_account() -> None:
    assert bootstrap.CONTROL_PLANE_SA == ca_mod.CONTROL_PLANE_SA
    assert bootstrap.control_plane_id(CALLER) == ca_mod.spiffe_id(TD, ca_mod.CONTROL_PLANE_SA)


def test_no_join_token_grants_the_control_planes_identity(cp) -> None:
    body = b'{"service_account": "meshlm-system/control-plane"}'
    status, doc = cp.identity.handle("POST", "/identity/tokens", body)
    assert status == 400 and "control plane" in doc["error"], doc


def test_global_rate_limit_takes_only_the_services_sidecars_and_keeps_buckets_on_restart(
    caplog,
) -> None:
    caplog.set_level(logging.INFO, logger="xds_server.server")
    with upstreams("v1") as ups:
        doc = {
            "services": {
                "llm": {
                    "versions": {"v1": {"endpoints": [ups["v1"].address]}},
                    "route": {"weights": {"v1": 100}},
                }
            },
            "tenants": {
                "acme": {
                    "key_sha256": hash_key("k-acme"),
                    "allow": ["llm/*"],
                    "rate_limit": {"max_tokens": 3, "tokens_per_fill": 1, "fill_interval": "1h"},
                }
            },
            "rate_limits": {"mode": "global"},
            "identity": {"trust_domain": TD},
        }
        with build_server(parse_mesh(doc), debounce=0.02) as cp:
            request = rls_pb2.RateLimitRequest(domain=DOMAIN)
            entries = request.descriptors.add().entries
            entries.add(key="tenant", value="acme")
            entries.add(key="service", value="llm")

            def ask(ch: grpc.Channel) -> str:
                reply = rls_pb2_grpc.RateLimitServiceStub(ch).ShouldRateLimit(
                    request, timeout=10, wait_for_ready=True
                )
                return rls_pb2.RateLimitResponse.Code.Name(reply.overall_code)

            with grpc.insecure_channel(f"127.0.0.1:{cp.grpc_port}") as plain:
                with pytest.raises(grpc.RpcError) as e:
                    rls_pb2_grpc.RateLimitServiceStub(plain).ShouldRateLimit(request, timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            with _channel(cp, CALLER) as other:  # not an inbound sidecar of llm
                with pytest.raises(grpc.RpcError) as e:
                    ask(other)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert CALLER in e.value.details()
            with _channel(cp, LLM) as ch:
                assert [ask(ch) for _ in range(3)] == ["OK"] * 3
                # A new root joins the trust bundle: the server restarts to take it.
                cp.identity.ca.rotate_root()
                eventually(lambda: "restarting its server" in caplog.text, what="restart")
                assert ask(ch) == "OVER_LIMIT"  # the same bucket, not a fresh one

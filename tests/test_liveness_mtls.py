"""A rollout's liveness probe on a mesh with mTLS (issue 14): the control plane probes the
canary's endpoints with its own certificate and counts one live when it proves the service's
SPIFFE ID. A plaintext probe is dropped by an mTLS listener, so before this no rollout could
start on a mesh with identity ("canary v2 has no live endpoint"), `meshlm demo` included."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from cryptography import x509
from cryptography.hazmat.primitives import hashes

from mesh_common.ports import free_port
from sidecar.bootstrap import with_sds
from sidecar.envoy_process import EnvoyProcess
from sidecar.sds import SdsServer, SecretStore
from tests.test_identity_support import identity_mesh, short_dir, tls_listener
from xds_server.compose import build_server
from xds_server.identity.ca import MeshCA, key_pem, new_key, spiffe_id
from xds_server.mesh.rollout_spec import RolloutSpec
from xds_server.rollout.liveness import not_live_reason
from xds_server.rollout.sources import configured_sources
from xds_server.server import XdsServer

LLM = "spiffe://meshlm.local/ns/default/sa/llm"


@contextmanager
def _tls_endpoint(port: int, ca: MeshCA, service_account: str) -> Iterator[None]:
    """A real Envoy TLS listener on `port` presenting a certificate of `ca` for
    `service_account`."""
    key = new_key()
    csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    chain = ca.sign(
        csr.sign(key, hashes.SHA256()), spiffe_id(ca.trust_domain, service_account), 600
    )
    store = SecretStore()
    store.set("".join(chain).encode(), key_pem(key), ca.bundle_pem())
    sds = SdsServer(store, str(short_dir() / "sds.sock")).start()
    boot = {
        "node": {"id": "tls-endpoint", "cluster": "test"},
        "static_resources": {"listeners": [tls_listener(port)]},
    }
    with_sds(boot, sds.path)
    try:
        with EnvoyProcess(boot):
            yield
    finally:
        sds.stop()


def _live(cp: XdsServer) -> list:
    spec = RolloutSpec(service="llm", stable="v1", canary="v1")
    return configured_sources(cp)(spec).live.read()


def test_the_canary_of_an_mtls_mesh_is_live_when_it_proves_the_service_identity() -> None:
    port = free_port()
    with build_server(identity_mesh(f"127.0.0.1:{port}")) as cp:
        ca = cp.identity.ca
        with _tls_endpoint(port, ca, "default/llm"):
            (seen,) = _live(cp)
        assert seen.live, seen
        assert seen.detail == f"mTLS handshake as {LLM}"
        # A replica holding another service's identity is not the canary.
        with _tls_endpoint(port, ca, "default/other"):
            (seen,) = _live(cp)
        assert not seen.live and LLM in seen.detail, seen
        # A certificate of another CA fails the handshake.
        with _tls_endpoint(port, MeshCA("meshlm.local"), "default/llm"):
            (seen,) = _live(cp)
        assert not seen.live and "handshake failed" in seen.detail, seen


def test_a_canary_port_with_nothing_listening_is_named_so_on_an_mtls_mesh() -> None:
    """The README's new user starts a rollout before the canary's runtime and sidecar: the
    refusal says nothing listens there, not "mTLS handshake failed: Connection refused"."""
    port = free_port()
    with build_server(identity_mesh(f"127.0.0.1:{port}")) as cp:
        (seen,) = _live(cp)
        assert not seen.live and seen.detail == "nothing listening", seen
        reason = not_live_reason("v1", [seen])
    assert reason == (
        f"v1 has no live endpoint (nothing listening at 127.0.0.1:{port}): "
        "is the v1 runtime and its sidecar running?"
    )

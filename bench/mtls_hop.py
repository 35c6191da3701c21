"""One mesh hop with mTLS vs the same hop plaintext (issue 14, item 6), as static Envoys.

A hop is a caller Envoy (a plaintext listener for the load generator, a cluster to the inbound
sidecar) and an inbound Envoy in front of the upstream, both bare (router only, bench/
sidecar_parts.py) so that the transport between them is the only difference. With mTLS both ends
take the control plane's own TLS contexts (xds_server/resources/tls.py: TLS 1.3, h2, SAN checks) and
read their certificates by SDS from a unix socket, as a sidecar's identity agent serves them
(sidecar/sds.py); the certificates come from the mesh CA (xds_server/identity/ca.py), with no
control plane. `new_connection_per_call`: the caller's cluster closes each upstream connection after
one call (`max_requests_per_connection: 1`), so every call pays a handshake."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from google.protobuf import json_format

from bench import sidecar_parts as parts
from sidecar.bootstrap import with_sds
from sidecar.sds import SdsServer, SecretStore
from xds_server import mesh as m
from xds_server.identity.ca import MeshCA, key_pem, new_key, spiffe_id
from xds_server.resources import tls

TRUST_DOMAIN = "meshlm.local"
CALLER, SERVICE = "default/caller", "default/llm"
_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def mesh(upstream: int, *, identity: bool) -> m.Mesh:
    raw: dict[str, Any] = {
        "services": {
            "llm": {
                "service_account": SERVICE,
                "versions": {"v1": {"endpoints": [f"127.0.0.1:{upstream}"]}},
            }
        }
    }
    if identity:
        raw["identity"] = {"trust_domain": TRUST_DOMAIN, "cert_ttl": "1h"}
    return m.parse_mesh(raw)


class Identities:
    """Workload certificates of one mesh CA, each served by SDS on a unix socket of its own."""

    def __init__(self, workdir: Path) -> None:
        self.ca = MeshCA(TRUST_DOMAIN, cert_ttl=3600)
        self.workdir = workdir
        self._servers: list[SdsServer] = []

    def serve(self, service_account: str) -> str:
        """The SDS socket path of a new certificate for `service_account`."""
        key = new_key()
        csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
        signed = csr.sign(key, hashes.SHA256())
        chain = self.ca.sign(signed, spiffe_id(TRUST_DOMAIN, service_account), 3600)
        store = SecretStore()
        store.set("".join(chain).encode(), key_pem(key), self.ca.bundle_pem())
        path = str(self.workdir / f"sds-{len(self._servers)}.sock")
        self._servers.append(SdsServer(store, path).start())
        return path

    def close(self) -> None:
        for s in self._servers:
            s.stop()


def bootstraps(
    upstream: int, ids: Identities | None, *, new_connection_per_call: bool
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(caller bootstrap, inbound bootstrap, the caller's listener port) of one hop to the
    upstream on `upstream`; mTLS when `ids` is given."""
    plain = mesh(upstream, identity=False)
    inbound_res = parts.inbound_resources(plain, "llm", "v1", upstream)
    inbound = parts.bootstrap(inbound_res, (), xds_port=1)  # the unused RLS cluster
    inbound_port = parts.listener_port(inbound_res)
    caller_res = parts.inbound_resources(plain, "llm", "v1", inbound_port)
    caller = parts.bootstrap(caller_res, (), xds_port=1)
    (chain,) = inbound["static_resources"]["listeners"][0]["filter_chains"]
    cluster = caller["static_resources"]["clusters"][0]
    chain.pop("transport_socket", None)
    cluster.pop("transport_socket", None)
    if ids is not None:
        secure = mesh(upstream, identity=True)
        chain["transport_socket"] = _json(tls.inbound_transport_socket(secure))
        with_sds(inbound, ids.serve(SERVICE))
        ts = tls.caller_transport_socket(secure, secure.services["llm"])
        cluster["transport_socket"] = _json(ts)
        with_sds(caller, ids.serve(CALLER))
    if new_connection_per_call:
        opts = cluster["typed_extension_protocol_options"][_HTTP_OPTIONS]
        opts["common_http_protocol_options"] = {"max_requests_per_connection": 1}
    return caller, inbound, parts.listener_port(caller_res)


def _json(msg: Any) -> dict[str, Any]:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)

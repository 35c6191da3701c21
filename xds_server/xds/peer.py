"""Who calls the control plane's gRPC port, and what an ADS node's metadata may claim.

With identity on, the ADS port asks every client for a certificate of the mesh CA; the workload's
SPIFFE ID in it is the only thing the control plane believes. Node metadata is the sidecar's own
word, so it is trusted only as far as that identity allows: an inbound sidecar (one that asks for
a listener in front of a runtime) must hold the service account of the service it claims, since
it is counted among that service's replicas (rate-limit shares, xds_server/ratelimit/shares.py) and
given that service's inbound config; a caller-only sidecar may be any workload of the trust
domain (which services it may call is the inbound side's RBAC). Istio checks the same way: istiod
takes a proxy's identity from its certificate, not from what the proxy says it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from cryptography import x509

from xds_server import mesh as m
from xds_server.identity.ca import parse_spiffe_id, workload_id
from xds_server.xds.node import NodeInfo
from xds_server.xds.sync import NodeRejected


@dataclass(frozen=True)
class Peer:
    spiffe_id: str
    service_account: str  # "ns/sa"


def workload(context: grpc.aio.ServicerContext, trust_domain: str) -> Peer | None:
    """The workload of `trust_domain` whose certificate the TLS layer verified on this call."""
    certs = context.auth_context().get("x509_pem_cert") or []
    cert = x509.load_pem_x509_certificate(certs[0]) if certs else None
    spiffe_id = workload_id(cert, trust_domain) if cert else None
    if spiffe_id is None:
        return None
    _, service_account = parse_spiffe_id(spiffe_id)
    return Peer(spiffe_id, service_account)


def peer_of(context: grpc.aio.ServicerContext, trust_domain: str) -> Peer:
    """`workload(context)`, or NodeRejected (UNAUTHENTICATED) without one."""
    peer = workload(context, trust_domain)
    if peer is None:
        raise NodeRejected(
            "UNAUTHENTICATED",
            f"ADS needs a client certificate with one workload SPIFFE ID of trust domain "
            f"{trust_domain} (meshlm sidecar --identity)",
        )
    return peer


def claim_refused(node_id: str, group: NodeInfo, peer: Peer, mesh: m.Mesh) -> str | None:
    """Why `peer` may not be the sidecar `group` describes (None: it may)."""
    if group.inbound_port is None:
        return None
    svc = mesh.services.get(group.service or "")
    if svc is None:
        return (
            f"node {node_id!r} claims an inbound sidecar of service {group.service!r}, which "
            f"the mesh does not have (so no service account to check), as {peer.spiffe_id}"
        )
    if svc.service_account != peer.service_account:
        return (
            f"node {node_id!r} claims an inbound sidecar of service {svc.name!r} (service "
            f"account {svc.service_account}), but its certificate is {peer.spiffe_id}"
        )
    return None

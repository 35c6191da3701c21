"""mTLS on the data plane: the TLS contexts of the hop caller sidecar -> inbound
sidecar, with SPIFFE ID checks on both sides.

Both sides read their certificate (secret `default`) and the mesh's trust bundle (`ROOTCA`) by
SDS from their own sidecar's identity agent (sidecar/sds.py), never from the control plane, so a
renewal or a root rotation reaches Envoy without a push and no key crosses the ADS stream. The
hop sidecar -> its own runtime stays plaintext on loopback (the runtime listens on 127.0.0.1).
"""

from __future__ import annotations

import ipaddress

from envoy.config.core.v3 import base_pb2, config_source_pb2, grpc_service_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2, tls_pb2
from envoy.type.matcher.v3 import string_pb2
from google.protobuf import wrappers_pb2
from google.protobuf.message import Message

from mesh_common.sds_names import DEFAULT, ROOTCA, SDS_CLUSTER
from xds_server import mesh as m
from xds_server.identity.ca import spiffe_id
from xds_server.resources.common import pack

TRANSPORT_SOCKET = "envoy.transport_sockets.tls"
ALPN = ("h2",)  # gRPC; both ends are Envoys of this mesh
# Every party of a hop is an Envoy of this mesh: TLS 1.3 only. The maximum too: Envoy's client
# side defaults to a maximum of 1.2, so a minimum of 1.3 alone enables no version.
TLS_PARAMS = common_pb2.TlsParameters(
    tls_minimum_protocol_version=common_pb2.TlsParameters.TLSv1_3,
    tls_maximum_protocol_version=common_pb2.TlsParameters.TLSv1_3,
)


def mtls(mesh: m.Mesh) -> bool:
    """Whether the mesh's hops are mTLS: an `identity` block without `mtls: off`."""
    return mesh.identity is not None and mesh.identity.mtls == "strict"


def plaintext_warning(mesh: m.Mesh) -> str | None:
    """What the control plane says once at load about a mesh whose hops are plaintext."""
    if mesh.identity is None:
        return (
            "the mesh file has no `identity:` block: every hop between sidecars is plaintext "
            "and no sidecar proves who it is; add `identity: {}` for mTLS (workload identity)"
        )
    if mesh.identity.mtls == "off":
        return (
            "identity.mtls: off: every hop between sidecars is plaintext (certificates are "
            "still issued); remove it for mTLS"
        )
    return None


def sds_secret(name: str) -> secret_pb2.SdsSecretConfig:
    """A secret read from the sidecar's own agent over the unix-socket cluster `meshlm_sds`
    (sidecar/bootstrap.py with_sds)."""
    source = config_source_pb2.ApiConfigSource(
        api_type=config_source_pb2.ApiConfigSource.GRPC,
        transport_api_version=config_source_pb2.ApiVersion.V3,
        grpc_services=[
            grpc_service_pb2.GrpcService(
                envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=SDS_CLUSTER)
            )
        ],
    )
    return secret_pb2.SdsSecretConfig(
        name=name,
        sds_config=config_source_pb2.ConfigSource(
            api_config_source=source, resource_api_version=config_source_pb2.ApiVersion.V3
        ),
    )


def common_tls_context(peer: string_pb2.StringMatcher) -> tls_pb2.CommonTlsContext:
    """Our certificate, and a peer that must chain to the trust bundle and hold a URI SAN that
    `peer` matches (the combined context merges the SAN check into the SDS bundle)."""
    san = common_pb2.SubjectAltNameMatcher(
        san_type=common_pb2.SubjectAltNameMatcher.URI, matcher=peer
    )
    return tls_pb2.CommonTlsContext(
        tls_params=TLS_PARAMS,
        tls_certificate_sds_secret_configs=[sds_secret(DEFAULT)],
        combined_validation_context=tls_pb2.CommonTlsContext.CombinedCertificateValidationContext(
            default_validation_context=common_pb2.CertificateValidationContext(
                match_typed_subject_alt_names=[san]
            ),
            validation_context_sds_secret_config=sds_secret(ROOTCA),
        ),
        alpn_protocols=list(ALPN),
    )


def upstream_tls_context(peer_id: str, sni: str) -> tls_pb2.UpstreamTlsContext:
    """A caller's side of a hop: the replica must prove exactly `peer_id` (the service's SPIFFE
    ID), so a replica holding another identity is refused in the handshake."""
    return tls_pb2.UpstreamTlsContext(
        common_tls_context=common_tls_context(string_pb2.StringMatcher(exact=peer_id)), sni=sni
    )


def downstream_tls_context(trust_domain: str) -> tls_pb2.DownstreamTlsContext:
    """An inbound listener's side: a client certificate is required and must be a workload of
    the trust domain; which workloads may call which method is RBAC's business."""
    any_workload = string_pb2.StringMatcher(prefix=f"spiffe://{trust_domain}/")
    return tls_pb2.DownstreamTlsContext(
        common_tls_context=common_tls_context(any_workload),
        require_client_certificate=wrappers_pb2.BoolValue(value=True),
    )


def transport_socket(ctx: Message) -> base_pb2.TransportSocket:
    return base_pb2.TransportSocket(name=TRANSPORT_SOCKET, typed_config=pack(ctx))


def caller_transport_socket(mesh: m.Mesh, svc: m.Service) -> base_pb2.TransportSocket | None:
    """The transport socket of a caller-side cluster of `svc`'s replicas (None: plaintext). The
    SNI is the service name: every version's replicas hold the service's one identity."""
    if not mtls(mesh):
        return None
    assert mesh.identity is not None
    peer = spiffe_id(mesh.identity.trust_domain, svc.service_account)
    return transport_socket(upstream_tls_context(peer, sni=svc.name))


def inbound_transport_socket(mesh: m.Mesh) -> base_pb2.TransportSocket | None:
    """The transport socket of an inbound listener (None: plaintext)."""
    if not mtls(mesh):
        return None
    assert mesh.identity is not None
    return transport_socket(downstream_tls_context(mesh.identity.trust_domain))


def off_loopback(endpoints: tuple[m.Endpoint, ...]) -> list[m.Endpoint]:
    """The endpoints (IPv4, see parse_endpoint) that are not this host's loopback."""
    return [e for e in endpoints if not ipaddress.IPv4Address(e.host).is_loopback]

"""Whether a version has a live endpoint: a gRPC health check (grpc.health.v1) of each of its
endpoints, sent by the control plane itself, so no sidecar's word is taken for it.

An endpoint is live when it answers SERVING, or when an authz filter in front of it answers the
unauthenticated probe with UNAUTHENTICATED / PERMISSION_DENIED: a sidecar that speaks gRPC is
there, and the runtime behind it is judged by the gates on real calls. Connection refused,
UNAVAILABLE (e.g. a sidecar whose runtime is gone), NOT_SERVING or no answer in time: not live;
connection refused is said as "nothing listening".

With mTLS an inbound listener drops a plaintext probe, and gRPC Python checks a
server's certificate by host name, which a workload certificate (a URI SAN only) has not. So
the probe is a TLS handshake with the control plane's own certificate: the endpoint is live when
it proves the expected SPIFFE ID against the mesh's trust bundle (a sidecar is there, as an
authz denial shows for a plaintext probe; the runtime behind it is judged by the gates).
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from xds_server.identity.ca import load_chain_in_memory, uri_sans

AUTHZ_DENIALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
_REFUSED = "connection refused"  # in gRPC's UNAVAILABLE details when nothing listens


@dataclass(frozen=True)
class EndpointHealth:
    endpoint: str
    live: bool
    detail: str
    listening: bool = True  # False: the connection was refused


def nothing_listening(endpoint: str) -> EndpointHealth:
    return EndpointHealth(endpoint, False, "nothing listening", listening=False)


def probe(endpoint: str, timeout: float = 1.0) -> EndpointHealth:
    with grpc.insecure_channel(endpoint) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.RpcError as e:
            code = e.code()
            if code in AUTHZ_DENIALS:
                return EndpointHealth(endpoint, True, f"answered {code.name} (authz in front)")
            if code == grpc.StatusCode.UNAVAILABLE and _REFUSED in (e.details() or "").lower():
                return nothing_listening(endpoint)
            return EndpointHealth(endpoint, False, f"{code.name}: {e.details() or ''}".rstrip())
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return EndpointHealth(endpoint, resp.status == health_pb2.HealthCheckResponse.SERVING, status)


@dataclass(frozen=True)
class MtlsProbe:
    """How to probe an mTLS endpoint: a client context (our certificate, the trust bundle) and
    the SPIFFE ID the endpoint must prove."""

    context: ssl.SSLContext
    peer_id: str


def client_context(key_pem: bytes, chain_pem: bytes, bundle_pem: bytes) -> ssl.SSLContext:
    """A TLS client context presenting `chain_pem` and trusting `bundle_pem` only; no host
    name check (the peer's SPIFFE ID is checked after the handshake)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cadata=bundle_pem.decode())
    ctx.set_alpn_protocols(["h2"])
    load_chain_in_memory(ctx, chain_pem, key_pem)
    return ctx


def probe_mtls(endpoint: str, how: MtlsProbe, timeout: float = 1.0) -> EndpointHealth:
    host, _, port = endpoint.rpartition(":")
    try:
        with (
            socket.create_connection((host, int(port)), timeout=timeout) as raw,
            how.context.wrap_socket(raw) as tls,
        ):
            der = tls.getpeercert(binary_form=True)
    except ConnectionRefusedError:
        return nothing_listening(endpoint)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        return EndpointHealth(endpoint, False, f"mTLS handshake failed: {e}")
    sans = uri_sans(x509.load_der_x509_certificate(der)) if der else []
    if how.peer_id not in sans:
        return EndpointHealth(
            endpoint, False, f"presents {sans or 'no SPIFFE ID'}, not {how.peer_id}"
        )
    return EndpointHealth(endpoint, True, f"mTLS handshake as {how.peer_id}")


class GrpcHealthSource:
    """Probes a version's endpoints; `endpoints` is a list or a function asked at every read
    (the mesh's endpoints change through the admin API); `mtls`, asked at every read: None
    for a plaintext mesh, else how to probe over mTLS."""

    def __init__(
        self,
        endpoints: list[str] | Callable[[], list[str]],
        *,
        timeout: float = 1.0,
        mtls: Callable[[], MtlsProbe | None] = lambda: None,
    ) -> None:
        self._endpoints = endpoints if callable(endpoints) else (lambda: list(endpoints))
        self.timeout = timeout
        self._mtls = mtls

    def read(self) -> list[EndpointHealth]:
        how = self._mtls()
        if how is not None:
            return [probe_mtls(e, how, self.timeout) for e in self._endpoints()]
        return [probe(e, self.timeout) for e in self._endpoints()]


def not_live_reason(version: str, results: list[EndpointHealth]) -> str | None:
    """None when some endpoint is live, else why the version counts as down (asking whether
    its runtime and sidecar run when nothing listens at an endpoint)."""
    if any(r.live for r in results):
        return None
    if not results:
        return f"{version} has no endpoint in the mesh"
    seen = "; ".join(
        f"{r.detail} at {r.endpoint}" if not r.listening else f"{r.endpoint}: {r.detail}"
        for r in results
    )
    if any(not r.listening for r in results):
        return (
            f"{version} has no live endpoint ({seen}): "
            f"is the {version} runtime and its sidecar running?"
        )
    return f"{version} has no live endpoint ({seen})"

"""Whether a version has a live endpoint: a gRPC health check (grpc.health.v1) of each of its
endpoints, sent by the control plane itself, so no sidecar's word is taken for it.

An endpoint is live when it answers SERVING, or when an authz filter in front of it answers the
unauthenticated probe with UNAUTHENTICATED / PERMISSION_DENIED: a sidecar that speaks gRPC is
there, and the runtime behind it is judged by the gates on real calls. Connection refused,
UNAVAILABLE (e.g. a sidecar whose runtime is gone), NOT_SERVING or no answer in time: not live.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

AUTHZ_DENIALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


@dataclass(frozen=True)
class EndpointHealth:
    endpoint: str
    live: bool
    detail: str


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
            return EndpointHealth(endpoint, False, f"{code.name}: {e.details() or ''}".rstrip())
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return EndpointHealth(endpoint, resp.status == health_pb2.HealthCheckResponse.SERVING, status)


class GrpcHealthSource:
    """Probes a version's endpoints; `endpoints` is a list or a function asked at every read
    (the mesh's endpoints change through the admin API)."""

    def __init__(
        self, endpoints: list[str] | Callable[[], list[str]], *, timeout: float = 1.0
    ) -> None:
        self._endpoints = endpoints if callable(endpoints) else (lambda: list(endpoints))
        self.timeout = timeout

    def read(self) -> list[EndpointHealth]:
        return [probe(e, self.timeout) for e in self._endpoints()]


def not_live_reason(version: str, results: list[EndpointHealth]) -> str | None:
    """None when some endpoint is live, else why the version counts as down."""
    if any(r.live for r in results):
        return None
    if not results:
        return f"{version} has no endpoint in the mesh"
    seen = "; ".join(f"{r.endpoint}: {r.detail}" for r in results)
    return f"{version} has no live endpoint ({seen})"

"""Is the control plane alive, and ready to serve ADS?

One answer, two doors: `GET /healthz` and `GET /readyz` on the admin port, and
`grpc.health.v1.Health` on the ADS port (service "" and the ADS service's name).

Alive: the process answers. Ready: its gRPC port is bound and serving a snapshot of the desired
state (read from the mesh file or, for a replica, from the store before the port opened).

A replica on a store stays ready when the store stops answering (etcd lost quorum, a partition):
the sidecars connected to it keep their config either way, and a sidecar that (re)connects gets
the last good config, which is what it would have held anyway; marking every replica unready
then would take them all out of a Service's endpoints and leave reconnecting sidecars with
nothing. What pauses is writing (changes answer 503) and the leader's work (rollouts, SLO loop,
which step down with the lease). A follower is ready like the leader: each serves ADS.

A replica is not ready while what it serves is not what the store says: its watch loop failed
(it tries again), or the store holds a document it refused (a value no admin request could have
written: wrong shape, nested too deep). It serves the last good version all the same; the
reason names the key and field, and readiness returns when the document is replaced.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ADS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"
SERVICES = ("", ADS_SERVICE)  # "": the server as a whole (grpc health protocol)
WATCH_EVERY = 0.5  # seconds between two looks at readiness for a Watch stream


Readiness = tuple[bool, dict[str, Any]]  # (ready, what a person reading /readyz needs to know)


def readiness(
    *, serving: bool, ads_port: int, generation: int, replica: dict[str, Any] | None
) -> Readiness:
    """Readiness from the ADS server's state: whether it `serving`, its port, the newest staged
    generation and, for a replica on a store, `Replication.status()`."""
    detail: dict[str, Any] = {"ads_port": ads_port, "generation": generation}
    if not serving:
        return False, {**detail, "reason": "the ADS server is not serving (starting or stopping)"}
    if replica is not None:
        error = replica["store_error"]
        detail["replica"] = replica["replica"]
        detail["store_revision"] = replica["revision"]
        detail["store"] = (
            f"not answering ({error}): serving the last good config, changes refused"
            if error
            else "answering"
        )
        if replica["watch_error"]:
            why = f"the store watch failed ({replica['watch_error']}): serving the last good config"
            return False, {**detail, "reason": why}
        if replica["rejected"]:
            refused = "; ".join(replica["rejected"].values())
            why = f"the store holds a document refused ({refused}): serving its last good version"
            return False, {**detail, "reason": why, "rejected": replica["rejected"]}
    return True, detail


def http(path: str, ready: Callable[[], Readiness]) -> tuple[int, dict[str, Any]]:
    """The admin port's reply to GET /healthz or /readyz; `ready()` gives the readiness."""
    if path == "healthz":
        return 200, {"status": "alive"}
    is_ready, detail = ready()
    return (200 if is_ready else 503), {"status": "ready" if is_ready else "not ready", **detail}


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 for a grpc.aio server, answering from `ready()` at each call."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self._ready = ready

    def _status(self, service: str) -> int | None:
        if service not in SERVICES:
            return None
        if self._ready():
            return health_pb2.HealthCheckResponse.SERVING
        return health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self._status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        # The protocol: an unknown service is SERVICE_UNKNOWN on the stream, not an error.
        last = None
        while True:
            status = self._status(request.service)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            await asyncio.sleep(WATCH_EVERY)


def add_to_server(server: grpc.aio.Server, servicer: HealthServicer) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)

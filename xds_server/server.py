"""The control plane serving its sidecars: the desired state (`ControlPlane`) with the gRPC port
around it and what keeps that port current.

`XdsServer` serves ADS and the services given to it (xds_server/compose.py builds them: the
tenants' mesh-wide rate limits, the caller sidecars' access logs, grpc.health.v1, CSDS, workload
registration) on one
gRPC port; with an `identity` block the mesh CA on its own two ports, and the gRPC port over
mTLS with a certificate it renews. `start()` binds and starts them in the loop thread, then the
debouncer and the loops that restage when quarantines change or sidecars come and go; `stop()`
undoes it in reverse.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import grpc
from envoy.service.discovery.v3 import ads_pb2, discovery_pb2

from mesh_common.listen import listen_error
from mesh_common.loop_thread import LoopThread
from xds_server.control_plane import ControlPlane
from xds_server.identity.workload import REFRESH_INTERVAL, Identity
from xds_server.ratelimit import shares as membership
from xds_server.registry.table import Registry
from xds_server.replica.replication import Replication
from xds_server.slo.quarantine import Isolation, push_loop
from xds_server.xds import health, wire
from xds_server.xds.ads import AdsServicer
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.sync import Limits, SyncStatus

log = logging.getLogger(__name__)

GRPC_OPTIONS = [
    # Linux lets a second SO_REUSEPORT server share the port and take half of the sidecars;
    # gRPC sets it unless told not to.
    ("grpc.so_reuseport", 0),
    ("grpc.max_concurrent_streams", 100_000),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # Streams that arrived and wait for the server to take them up: gRPC cancels those past
    # 1,000 by default, which a connection storm of a few thousand sidecars reaches (measured:
    # a quarter of 2,000 reconnecting streams cancelled). Room for the whole node table.
    ("grpc.server.max_pending_requests", Limits.max_nodes),
    ("grpc.server.max_pending_requests_hard_limit", Limits.max_nodes),
]


def _add_ads(server: grpc.aio.Server, servicer: AdsServicer) -> None:
    """As the generated `add_AggregatedDiscoveryServiceServicer_to_server`, with a serializer
    that sends the streams' shared, already serialized responses as they are (xds/wire.py)."""
    handlers = {
        "StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(
            servicer.StreamAggregatedResources,
            request_deserializer=discovery_pb2.DiscoveryRequest.FromString,
            response_serializer=wire.serialize,
        ),
        "DeltaAggregatedResources": grpc.stream_stream_rpc_method_handler(
            servicer.DeltaAggregatedResources,
            request_deserializer=discovery_pb2.DeltaDiscoveryRequest.FromString,
            response_serializer=wire.serialize,
        ),
    }
    name = ads_pb2.DESCRIPTOR.services_by_name["AggregatedDiscoveryService"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


class Debouncer:
    """Bursts of changes go out as one push (istiod: 100 ms): `schedule()` publishes after a
    quiet `delay`, but never later than 10 x `delay` after the first change of a burst. Before
    `run_in(loop)` (and after `stop()`) it publishes at once."""

    def __init__(self, publish: Callable[[], None], delay: float) -> None:
        self.publish = publish
        self.delay = delay
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush: asyncio.TimerHandle | None = None
        self._first_pending = 0.0

    def run_in(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def stop(self) -> None:
        self._loop = None

    def schedule(self) -> None:
        loop = self._loop
        if loop is None:
            self.publish()
            return
        loop.call_soon_threadsafe(self._touch, loop)

    def _touch(self, loop: asyncio.AbstractEventLoop) -> None:
        now = time.monotonic()
        if self._flush is None:
            self._first_pending = now
        else:
            self._flush.cancel()
        delay = min(self.delay, self._first_pending + 10 * self.delay - now)
        self._flush = loop.call_later(max(0.0, delay), self._fire)

    def _fire(self) -> None:
        self._flush = None
        self.publish()


class GrpcService(NamedTuple):
    """A service on the gRPC port: `add_to_server(server, servicer)` registers it."""

    add_to_server: Callable[[grpc.aio.Server, Any], None]
    servicer: Any


class XdsServer(ControlPlane):
    """A ControlPlane with its gRPC port, the mesh CA's ports and the loops that keep them
    current, from parts built by xds_server/compose.py (`build_server`). Nothing is bound or
    started before start()."""

    def __init__(
        self,
        cache: SnapshotCache,
        sync: SyncStatus,
        isolation: Isolation,
        *,
        ads: AdsServicer,
        services: list[GrpcService],
        debouncer: Debouncer,
        members_changed: threading.Event,
        identity: Identity | None = None,
        mtls: bool = False,
        replication: Replication | None = None,
        registry: Registry | None = None,
        token_budgets: Any = None,
    ) -> None:
        """`ads` and `services` are served on the gRPC port, the same servicers across
        restarts of its server (rate-limit buckets live in one); over mTLS when `mtls`, with
        a certificate of `identity`'s CA, which serves on ports of its own. `debouncer`
        publishes the staged changes; `members_changed` is set when a sidecar joins or
        leaves (the rate-limit shares are re-divided then). `replication`: this server is one
        replica of several sharing a store. `registry`: the hosts registered on the gRPC
        port's registration service (one of `services`); `token_budgets` the mesh-wide token
        budgets' servicer (one of `services`), which the admin API reads."""
        super().__init__(
            cache,
            sync,
            isolation,
            publish=debouncer.schedule,
            replication=replication,
            registry=registry,
        )
        self.identity = identity
        self.token_budgets = token_budgets
        self.ads_mtls = mtls
        self._ads = ads
        self._services = [GrpcService(_add_ads, ads), *services]
        self._debouncer = debouncer
        self._members_changed = members_changed
        self._tls_served: tuple[bytes, bytes] = (b"", b"")  # chain, trust bundle
        self._tls_renewer: asyncio.Task | None = None
        self._runner: LoopThread | None = None
        self._server: grpc.aio.Server | None = None
        self._loops_stop = threading.Event()
        self.grpc_port = 0

    @property
    def debounce(self) -> float:
        return self._debouncer.delay

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, grpc_port: int = 0, host: str = "127.0.0.1") -> XdsServer:
        """The store's state first (a replica), then the gRPC and CA ports, then the loops."""
        if self.replication is not None:  # the store's state before the first sidecar's
            self.replication.start(self)
        self._runner = LoopThread("xds")
        self.grpc_port = self._runner.start(lambda: self._boot(host, grpc_port))
        self._debouncer.run_in(self._runner.loop)
        self._loops_stop.clear()
        for target, args, name in (
            (push_loop, (self.isolation, self.push_isolation), "isolation"),
            (membership.push_loop, (self._members_changed, self.push_shares), "rate-limit-shares"),
        ):
            threading.Thread(
                target=target, args=(*args, self._loops_stop), name=name, daemon=True
            ).start()
        return self

    def stop(self, grace: float = 0.5) -> None:
        if self._runner is None or self._server is None:
            return
        self._loops_stop.set()
        self._debouncer.stop()  # from now on a change is published at once
        if self.replication is not None:
            self.replication.stop()

        async def shutdown() -> None:
            if self._tls_renewer:
                self._tls_renewer.cancel()
            await self._ads.close()  # sidecars see UNAVAILABLE "control plane stopping"
            if self.identity:
                await self.identity.stop()
            await self._server.stop(grace)

        self._runner.stop(shutdown, timeout=grace + 10)  # and it cancels the open streams
        self.registry.close()
        self._server = None

    @property
    def serving(self) -> bool:
        """The ADS port is bound and serving (from start() until stop())."""
        return self._server is not None

    def readiness(self) -> health.Readiness:
        """Ready to serve ADS (GET /readyz, grpc.health.v1)."""
        return health.readiness(
            serving=self.serving,
            ads_port=self.grpc_port,
            generation=self.cache.generation,
            replica=self.replication.status() if self.replication is not None else None,
        )

    def __enter__(self) -> XdsServer:
        return self if self._server else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _boot(self, host: str, port: int) -> int:
        """Bind and start the servers (in the loop thread); the bound gRPC port."""
        reason = listen_error(host, port)  # before gRPC, which would log its own error
        if reason:
            raise OSError(reason)
        server, bound = self._grpc_server(host, port)
        if self.identity:  # the CSR signing service on its TLS ports
            cp = self.mesh.control_plane
            ports = [
                p if p is not None else (port + 2 + i if port else 0)
                for i, p in enumerate((cp.ca_port, cp.ca_mtls_port))
            ]
            for p in ports:
                reason = listen_error(host, p)
                if reason:
                    raise OSError(f"CA port {p}: {reason}")
            await self.identity.start(host, *ports)
        await server.start()
        self._server = server
        if self.ads_mtls:
            self._tls_renewer = asyncio.create_task(self._renew_tls(host, bound))
        return bound

    def _grpc_server(self, host: str, port: int) -> tuple[grpc.aio.Server, int]:
        """The server of every service on the gRPC port, bound to `host:port`."""
        server = grpc.aio.server(options=GRPC_OPTIONS)
        for add, servicer in self._services:
            add(server, servicer)
        address = f"{host}:{port}"
        try:
            if self.ads_mtls:
                bound = server.add_secure_port(address, self._tls_credentials())
            else:
                bound = server.add_insecure_port(address)
        except RuntimeError:  # taken between the check and now
            bound = 0
        if not bound or (port and bound != port):
            raise OSError(listen_error(host, port) or f"gRPC could not bind {address}")
        return server, bound

    def _tls_credentials(self) -> grpc.ServerCredentials:
        """The CA's certificate for the control plane's SPIFFE ID (the CA ports' own), and a
        client certificate of the mesh's trust bundle required."""
        key, chain, _ = self.identity.ca.serving_credentials()
        bundle = self.identity.ca.bundle_pem()
        self._tls_served = (chain, bundle)
        return grpc.ssl_server_credentials([(key, chain)], bundle, require_client_auth=True)

    async def _renew_tls(self, host: str, port: int) -> None:
        """Serve a renewed certificate (at half-life, or a new signer) or a new trust bundle
        (root rotation). Credentials are fixed per gRPC server (see
        xds_server/identity/workload.py), so the server restarts on the same port; Envoy
        reconnects within its 2 s back-off and the servicers, with their state, carry over."""
        while True:
            await asyncio.sleep(REFRESH_INTERVAL)
            _, chain, _ = self.identity.ca.serving_credentials()
            if (chain, self.identity.ca.bundle_pem()) == self._tls_served:
                continue
            log.info("ADS port: new certificate or trust bundle; restarting its server")
            await self._server.stop(0.5)
            while True:
                try:
                    server, _ = self._grpc_server(host, port)
                    await server.start()
                    self._server = server
                    break
                except OSError as e:  # the old socket may take a moment to go
                    log.warning("ADS port: %s; trying again", e)
                    await asyncio.sleep(0.2)

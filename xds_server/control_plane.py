"""The control plane as a Python API: change desired state, wait until the sidecars hold it.

    cp = ControlPlane(load_mesh("mesh.yaml")).start(grpc_port=18000)
    result = cp.set_weights("llm", {"v1": 90, "v2": 10}, timeout=10)
    result.ok, result.acked, result.missing, result.errors

A change counts as applied only when every affected, connected sidecar ACKed it (Argo Rollouts'
most-reported bug is 503s from acting before the sidecars have the new routes), except sidecars
that have left a push un-ACKed for `control_plane.lagging_after`: those are reported as lagging
and no longer hold changes back, so one stuck sidecar cannot fail every change.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc

from mesh_common.listen import listen_error
from mesh_common.loop_thread import LoopThread
from xds_server import mesh as m
from xds_server.identity.workload import REFRESH_INTERVAL, Identity
from xds_server.ratelimit import service as ratelimit
from xds_server.ratelimit import shares as membership
from xds_server.resources import tls
from xds_server.slo import access_log_service as accesslog
from xds_server.slo.quarantine import Isolation, push_loop
from xds_server.xds import csds, health
from xds_server.xds.ads import AdsServicer
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.snapshot import make_version
from xds_server.xds.sync import Limits, SyncStatus

if TYPE_CHECKING:
    from xds_server.replica.replication import Replication
    from xds_server.store.base import Fence

log = logging.getLogger(__name__)
# The longest a caller may wait for ACKs (seconds); longer asks are refused before staging.
MAX_TIMEOUT = 600.0


@dataclass(frozen=True)
class ApplyResult:
    """The outcome of one change. `ok` when every affected sidecar ACKed it."""

    version: str
    ok: bool
    acked: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # NACKed or not yet ACKed
    errors: dict[str, str] = field(default_factory=dict)  # node -> NACK error
    lagging: list[str] = field(default_factory=list)  # left out: un-ACKed for lagging_after
    revision: int = 0  # the store revision written (replicas on a store, issue 15)
    changed: bool = True  # False: the desired state was already so (a no-op change)

    def to_json(self) -> dict:
        out = {
            "version": self.version,
            "ok": self.ok,
            "changed": self.changed,
            "acked": self.acked,
            "missing": self.missing,
            "errors": self.errors,
            "lagging": self.lagging,
        }
        if self.revision:
            out["revision"] = self.revision
        return out


def check_timeout(timeout: float) -> float:
    """`timeout` if it is a number of seconds from 0 to MAX_TIMEOUT, else ValueError."""
    try:
        ok = not isinstance(timeout, bool) and 0 <= float(timeout) <= MAX_TIMEOUT
    except (TypeError, ValueError):
        ok = False
    if not ok:  # NaN compares false too
        raise ValueError(f"timeout: must be 0 to {MAX_TIMEOUT:g} seconds, got {timeout!r}")
    return float(timeout)


def new_incarnation() -> str:
    """A token per server start: time (ms, base 36) + random, so versions never repeat."""
    return f"{_b36(int(time.time() * 1000))}{secrets.token_hex(2)}"


class ControlPlane:
    def __init__(
        self,
        mesh: m.Mesh,
        *,
        debounce: float | None = None,
        incarnation: str | None = None,
        limits: Limits | None = None,
        isolation_store: str | None = None,
        identity_dir: str | None = None,
        replication: Replication | None = None,
    ) -> None:
        """`identity_dir`: where the mesh CA keeps its root and join tokens (a private dir);
        None keeps them in memory. The CA runs only when the mesh has an `identity` block.
        `replication`: this control plane is one replica of several sharing a store (issue 15);
        its desired state is the store's, and changes are written there."""
        self.replication = replication
        self._fence = threading.local()  # the leader's fence for the current thread's writes
        self.incarnation = incarnation or new_incarnation()
        # Quarantined request classes (issue 11); restored ones are in the very first snapshot,
        # so a restart leaves no window of unprotected traffic.
        self.isolation = Isolation(lambda: self.cache.mesh, isolation_store)
        mesh = self.isolation.overlay(mesh)
        self.cache = SnapshotCache(mesh, self.incarnation)
        limits = limits or Limits(lagging_after=mesh.control_plane.lagging_after)
        self._members_changed = threading.Event()  # rate-limit shares to re-divide (issue 19)
        self.sync = SyncStatus(
            self.cache.expected_generations,
            self.cache.generation_of,
            limits,
            retain_groups=self.cache.retain,
            membership_changed=self._members_changed.set,
        )
        self.debounce = mesh.control_plane.debounce if debounce is None else debounce
        self.identity = Identity(mesh.identity, identity_dir) if mesh.identity else None
        # ADS (and the rate-limit and access-log services on its port) over mTLS (issue 14).
        self.ads_mtls = tls.mtls(mesh)
        td = mesh.identity.trust_domain if self.ads_mtls else None
        # One servicer each across restarts of the server (rate-limit buckets live in one).
        self._ads = AdsServicer(self.cache, self.sync, td)
        self._rls = ratelimit.RateLimitServicer(lambda: self.cache.mesh, trust_domain=td)
        self._als = accesslog.AccessLogServicer(self.isolation)
        self._health = health.HealthServicer(lambda: self.serving)  # grpc.health.v1 (issue 16)
        self._csds = csds.CsdsServicer(self.cache, self.sync)  # proxy-status (issue 16)
        self._tls_served: tuple[bytes, bytes] = (b"", b"")  # chain, trust bundle
        self._tls_renewer: asyncio.Task | None = None
        self._mutate = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: LoopThread | None = None
        self._server: grpc.aio.Server | None = None
        self._flush: asyncio.TimerHandle | None = None
        self._first_pending = 0.0
        self.grpc_port = 0

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, grpc_port: int = 0, host: str = "127.0.0.1") -> ControlPlane:
        if self.replication is not None:  # the store's state before the first sidecar's
            self.replication.start(self)
        self._runner = LoopThread("xds")
        self._loop = self._runner.loop
        self.grpc_port = self._serve(host, grpc_port)
        self._isolation_stop = threading.Event()
        threading.Thread(
            target=push_loop,
            args=(self.isolation, self._push_isolation, self._isolation_stop),
            name="isolation",
            daemon=True,
        ).start()
        threading.Thread(
            target=membership.push_loop,
            args=(self._members_changed, self._push_shares, self._isolation_stop),
            name="rate-limit-shares",
            daemon=True,
        ).start()
        return self

    def stop(self, grace: float = 0.5) -> None:
        if self._loop is None or self._server is None:
            return
        self._isolation_stop.set()
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
        self._server = None

    @property
    def serving(self) -> bool:
        """The ADS port is bound and serving (from start() until stop())."""
        return self._server is not None

    def __enter__(self) -> ControlPlane:
        return self if self._server else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self, host: str, port: int) -> int:
        """Bind and start the servers in the loop thread; the bound gRPC port."""

        async def boot() -> int:
            reason = listen_error(host, port)  # before gRPC, which would log its own error
            if reason:
                raise OSError(reason)
            server, bound = self._grpc_server(host, port)
            if self.identity:  # the CSR signing service on its TLS ports (issue 14)
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

        return self._runner.start(boot)

    def _grpc_server(self, host: str, port: int) -> tuple[grpc.aio.Server, int]:
        """The server of ADS, tenants' mesh-wide rate limits (sidecars reach it by
        xds_cluster) and caller sidecars' access logs (issue 11), bound to `host:port`."""
        server = grpc.aio.server(
            options=[
                # Linux lets a second SO_REUSEPORT server share the port and take half of
                # the sidecars; gRPC sets it unless told not to.
                ("grpc.so_reuseport", 0),
                ("grpc.max_concurrent_streams", 100_000),
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ]
        )
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self._ads, server)
        ratelimit.add_to_server(server, self._rls)
        accesslog.add_to_server(server, self._als)
        health.add_to_server(server, self._health)
        csds.add_to_server(server, self._csds)
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
        xds_server/identity/workload.py), so
        the server restarts on the same port; Envoy reconnects within its 2 s back-off and the
        servicers, with their state, carry over."""
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

    # -- desired state --------------------------------------------------------------------------
    @property
    def mesh(self) -> m.Mesh:
        return self.cache.mesh

    def set_weights(
        self, service: str, weights: dict[str, int], *, timeout: float = 10.0
    ) -> ApplyResult:
        return self._change(lambda live: live.with_weights(service, weights), timeout)

    def add_endpoint(
        self, service: str, version: str, endpoint: str, *, timeout: float = 10.0
    ) -> ApplyResult:
        return self._change(
            lambda live: live.with_endpoint(service, version, endpoint, add=True), timeout
        )

    def remove_endpoint(
        self, service: str, version: str, endpoint: str, *, timeout: float = 10.0
    ) -> ApplyResult:
        return self._change(
            lambda live: live.with_endpoint(service, version, endpoint, add=False), timeout
        )

    def set_pins(
        self, service: str, stable: str, canary: str, *, timeout: float = 10.0
    ) -> ApplyResult | None:
        """Which versions `x-canary: never|always` reach; None when they already do."""

        def pinned(live: m.Mesh) -> m.Mesh | None:
            if live.services[service].route.pins == (stable, canary):
                return None
            return live.with_pins(service, stable, canary)

        return self._change(pinned, timeout)

    def set_mirror(
        self, service: str, mirror: m.Mirror | None, *, timeout: float = 10.0
    ) -> ApplyResult | None:
        """The quality gate's mirror (issue 18) on the callers' routes; None when already so."""

        def edit(live: m.Mesh) -> m.Mesh | None:
            if live.services[service].route.mirror == mirror:
                return None
            return live.with_mirror(service, mirror)

        return self._change(edit, timeout)

    def set_slo_state(
        self, service: str, state: m.SloState, *, timeout: float = 10.0
    ) -> ApplyResult | None:
        """The SLO loop's actions in force (xds_server/slo/loop.py); None when already so."""

        def edit(live: m.Mesh) -> m.Mesh | None:
            if live.services[service].slo_state == state:
                return None
            return live.with_slo_state(service, state)

        return self._change(edit, timeout)

    def apply_mesh(self, mesh: m.Mesh, *, timeout: float = 10.0, source: Any = None) -> ApplyResult:
        """A new mesh file (tenants, endpoints, resilience...) that keeps the live traffic split:
        weights and `x-canary` pins of a service whose versions are unchanged belong to the
        weights API and rollouts, not to whatever the file said when it was written. `source`:
        the document `mesh` parsed from, which replicas keep in their store (needed there)."""

        def keep_split(live: m.Mesh) -> m.Mesh:
            new = mesh
            for name, svc in mesh.services.items():
                cur = live.services.get(name)
                if cur is None or set(cur.versions) != set(svc.versions):
                    continue
                new = new.with_weights(name, dict(cur.route.weights))
                if cur.route.pins:
                    new = new.with_pins(name, *cur.route.pins)
                if cur.route.mirror:
                    new = new.with_mirror(name, cur.route.mirror)
            return new

        return self._change(keep_split, timeout, self._source(source))

    def _source(self, source: Any) -> Any:
        if self.replication is not None and source is None:
            raise ValueError("a replica on a store needs the mesh's source document to apply it")
        return source

    def update_mesh(
        self, mesh: m.Mesh, *, timeout: float = 10.0, source: Any = None
    ) -> ApplyResult:
        return self._change(lambda live: mesh, timeout, self._source(source))

    @contextlib.contextmanager
    def fenced(self, fence: Fence) -> Iterator[None]:
        """The changes this thread makes inside are leader-only: written with `fence`, so they
        fail (Fenced) once the term has ended (replicas on a store)."""
        self._fence.value = fence
        try:
            yield
        finally:
            self._fence.value = None

    def _change(
        self,
        edit: Callable[[m.Mesh], m.Mesh | None],
        timeout: float,
        source: Any = None,
    ) -> ApplyResult | None:
        """Stage `edit(live mesh)` under the mutation lock, then wait for ACKs without it, so
        a slow sidecar (or a caller that left) never blocks the next change."""
        timeout = check_timeout(timeout)  # before anything is staged
        changed: list[bool] = []

        def noted(live: m.Mesh) -> m.Mesh | None:
            new = edit(live)
            if new is not None:
                counts = membership.inbound_sidecars(self.sync)
                mine = membership.overlay(self.isolation.overlay(new), counts)
                changed[:] = [mine != membership.overlay(live, counts)]
            return new

        if self.replication is not None:
            r = self._change_replicated(noted, timeout, source)
        else:
            r = self._change_here(noted, timeout)
        return dataclasses.replace(r, changed=changed[-1]) if r and changed else r

    def _change_here(
        self, edit: Callable[[m.Mesh], m.Mesh | None], timeout: float
    ) -> ApplyResult | None:
        with self._mutate:
            mesh = edit(self.mesh)
            if mesh is None:
                return None
            version, nodes = self._stage(self.isolation.overlay(mesh))
        if timeout == 0:
            return ApplyResult(version=version, ok=False, missing=nodes)
        return self.wait_for_ack(version, nodes, timeout=timeout)

    def _change_replicated(
        self, edit: Callable[[m.Mesh], m.Mesh | None], timeout: float, source: Any
    ) -> ApplyResult | None:
        """Written to the store, staged here; returns when every replica's sidecars hold it."""
        fence = getattr(self._fence, "value", None)
        done = self.replication.change(edit, source=source, fence=fence)
        if done is None:
            return None
        revision, gen = done
        version = make_version(self.incarnation, gen)
        if timeout == 0:
            return ApplyResult(version=version, ok=False, revision=revision)
        acked, errors, missing, lagging = self.replication.wait(revision, timeout)
        return ApplyResult(version, not missing, acked, missing, errors, lagging, revision)

    def _check_desired(self, mesh: m.Mesh) -> None:
        """ValueError if a group with a connected sidecar cannot take `mesh`; stages nothing."""
        mesh = membership.overlay(
            self.isolation.overlay(mesh), membership.inbound_sidecars(self.sync)
        )
        self.cache.check(mesh, self.sync.live_groups())

    def _stage_desired(self, mesh: m.Mesh) -> int:
        """Stage `mesh` (desired state, read from the store) with the isolation controller's
        routes over it; the new generation. The caller holds the mutation lock."""
        self._stage(self.isolation.overlay(mesh))
        return self.cache.generation

    def _push_isolation(self) -> tuple[m.Mesh, ApplyResult] | None:
        """The isolation controller's routes, when they differ from the live ones."""
        with self._mutate:
            mesh = self.isolation.overlay(self.mesh)
            if mesh is self.mesh:
                return None
            version, nodes = self._stage(mesh)
        return mesh, self.wait_for_ack(version, nodes, timeout=10.0)

    def _push_shares(self) -> None:
        """A sidecar joined or left: re-divide tenants' rate limits when any are divided."""
        with self._mutate:
            mesh = membership.overlay(self.mesh, membership.inbound_sidecars(self.sync))
            if mesh is not self.mesh and membership.shares_matter(mesh):
                self._stage(mesh)

    def _stage(self, mesh: m.Mesh) -> tuple[str, list[str]]:
        # Raises (nothing staged, nothing pushed) when a group with a connected sidecar cannot
        # take the mesh; groups of departed sidecars never veto (they are dropped).
        mesh = membership.overlay(mesh, membership.inbound_sidecars(self.sync))
        gen = self.cache.stage(mesh, self.sync.live_groups())
        lagging_after = mesh.control_plane.lagging_after
        if lagging_after != self.sync.limits.lagging_after:
            self.sync.limits = dataclasses.replace(self.sync.limits, lagging_after=lagging_after)
        nodes = self._affected(gen)
        self.sync.track(gen, nodes)
        self._schedule_publish()
        return make_version(self.incarnation, gen), nodes

    def _affected(self, generation: int) -> list[str]:
        groups = set(self.cache.changed_groups(generation))
        with self.sync.cond:
            return sorted(
                n for n, ns in self.sync.nodes.items() if ns.connected and ns.group in groups
            )

    def wait_for_ack(
        self, version: str, nodes: list[str] | None = None, *, timeout: float = 10.0
    ) -> ApplyResult:
        """Block until each of `nodes` (default: every connected sidecar the change touched)
        ACKed `version` or a later one, or NACKed it, or lags, or `timeout` passed."""
        timeout = check_timeout(timeout)
        gen = self.cache.generation_of(version)
        if gen < 0:
            raise ValueError(f"version {version!r} is not from this control plane")
        if nodes is None:
            nodes = self._affected(gen)
        acked, errors, missing, lagging = self.sync.wait(gen, nodes, timeout)
        return ApplyResult(
            version=version,
            ok=not missing,
            acked=acked,
            missing=missing,
            errors=errors,
            lagging=lagging,
        )

    # -- debounce: bursts of changes go out as one push (istiod: 100 ms) ----------------------
    def _schedule_publish(self) -> None:
        if self._loop is None:
            self.cache.publish()
            return
        self._loop.call_soon_threadsafe(self._touch)

    def _touch(self) -> None:
        now = time.monotonic()
        if self._flush is None:
            self._first_pending = now
        else:
            self._flush.cancel()
        # Wait for a quiet `debounce`, but never longer than 10 x debounce in all.
        delay = min(self.debounce, self._first_pending + 10 * self.debounce - now)
        self._flush = self._loop.call_later(max(0.0, delay), self._fire)

    def _fire(self) -> None:
        self._flush = None
        self.cache.publish()

    # -- views ----------------------------------------------------------------------------------
    def syncz(self) -> dict:
        out = self.sync.to_json()
        out["incarnation"] = self.incarnation
        out["generation"] = self.cache.generation
        if self.replication is not None:
            out["replication"] = self.replication.status()
        return out

    def config_dump(self) -> dict:
        from google.protobuf import json_format

        from mesh_common import type_urls as t

        groups = []
        for group, snap in self.cache.groups().items():
            groups.append(
                {
                    "group": group.label(),
                    "generation": snap.generation,
                    "types": {
                        t.SHORT.get(tu, tu): {
                            "version": res.version,
                            "resources": {
                                n: redact(json_format.MessageToDict(a))
                                for n, a in res.items.items()
                            },
                        }
                        for tu, res in snap.types.items()
                        if res.items
                    },
                }
            )
        return {
            "incarnation": self.incarnation,
            "generation": self.cache.generation,
            "groups": groups,
        }


# Configs that carry plaintext credentials (native authz mode): the admin API is readable
# without a token, so their secrets are shown as Envoy shows sensitive fields.
_SECRET_FIELDS = {"ApiKeyAuth": "credentials", "ApiKeyAuthPerRoute": "credentials"}


def redact(doc: Any) -> Any:
    """A config-dump dict with plaintext credentials replaced by "[redacted]"."""
    if isinstance(doc, list):
        return [redact(x) for x in doc]
    if not isinstance(doc, dict):
        return doc
    out = {k: redact(v) for k, v in doc.items()}
    field = _SECRET_FIELDS.get(str(doc.get("@type", "")).rsplit(".", 1)[-1])
    if field and isinstance(out.get(field), list):
        out[field] = [{**c, "key": "[redacted]"} for c in out[field] if isinstance(c, dict)]
    return out


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while n:
        n, r = divmod(n, 36)
        out = digits[r] + out
    return out or "0"

"""The control plane's desired state: change it, stage a snapshot per sidecar group, wait until
the sidecars hold it.

    server = build_server(load_mesh("mesh.yaml")).start(grpc_port=18000)  # xds_server/compose.py
    result = server.set_weights("llm", {"v1": 90, "v2": 10}, timeout=10)
    result.ok, result.acked, result.missing, result.errors

A change counts as applied only when every affected, connected sidecar ACKed it (Argo Rollouts'
most-reported bug is 503s from acting before the sidecars have the new routes), except sidecars
that have left a push un-ACKed for `control_plane.lagging_after`: those are reported as lagging
and no longer hold changes back, so one stuck sidecar cannot fail every change.

`ControlPlane` serves nothing itself and builds none of its collaborators: it is given them
(xds_server/compose.py builds them), and `XdsServer` (xds_server/server.py) runs the ports, loops
and renewals around it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from google.protobuf import json_format

from xds_server import mesh as m
from xds_server.mesh.faults import Fault, carried_over, with_fault
from xds_server.ratelimit import shares as membership
from xds_server.registry.table import Registry
from xds_server.slo.quarantine import Isolation
from xds_server.store.base import Fence, StoreError
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.csds import redact
from xds_server.xds.snapshot import make_version
from xds_server.xds.sync import SyncStatus

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
    revision: int = 0  # the store revision written (replicas on a store)
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


class SharedState(Protocol):
    """The desired state on a store shared by replicas (xds_server/replica/replication.py):
    where this control plane writes its changes and learns when every replica's sidecars hold
    them."""

    def change(
        self, edit: Callable[[m.Mesh], m.Mesh | None], *, source: Any, fence: Fence | None
    ) -> tuple[int, int] | None:
        """Write `edit(desired mesh)`, staging it here; (store revision, generation), or None
        when it changes nothing."""

    def wait(self, revision: int, timeout: float) -> tuple[list, dict, list, list]:
        """(acked, errors, missing, lagging) once every replica's sidecars hold `revision`."""

    def reload(self) -> None:
        """Read the store's desired state (registrations included) and stage it here."""

    def status(self) -> dict[str, Any]: ...


class ControlPlane:
    def __init__(
        self,
        cache: SnapshotCache,
        sync: SyncStatus,
        isolation: Isolation,
        *,
        publish: Callable[[], None] | None = None,
        replication: SharedState | None = None,
        registry: Registry | None = None,
    ) -> None:
        """`cache` holds the desired state (its mesh, with `isolation`'s quarantines over it) and
        the staged snapshots; `sync` what each sidecar holds. `publish()` sends the newest
        staged generation out, now or after a debounce (default: now). `replication`: this
        control plane is one replica of several sharing a store; its desired state is the
        store's, and changes are written there. `registry`: the hosts that registered
        themselves, laid over every change staged (None: an empty one)."""
        self.cache = cache
        self.sync = sync
        self.isolation = isolation
        self.incarnation = cache.incarnation
        self.replication = replication
        self.registry = registry if registry is not None else Registry()
        self._publish = publish or cache.publish
        # Held while the desired state is read and staged; replicas stage under it too.
        self.mutating = threading.Lock()
        self._fence = threading.local()  # the leader's fence for the current thread's writes

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
        """The quality gate's mirror on the callers' routes; None when already so."""

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

    def set_fault(self, fault: Fault, *, timeout: float = 10.0) -> ApplyResult | None:
        """Add or replace a fault (by name); None when the live mesh holds it already."""

        def edit(live: m.Mesh) -> m.Mesh | None:
            if live.faults.get(fault.name) == fault:
                return None
            return dataclasses.replace(live, faults=with_fault(live.faults, fault))

        return self._change(edit, timeout)

    def remove_fault(
        self, name: str, *, timeout: float = 10.0, only: Fault | None = None
    ) -> ApplyResult | None:
        """None when no fault of that name is live (or, with `only`, when the live one is not
        `only`: an expiry never removes a fault that was replaced meanwhile)."""

        def edit(live: m.Mesh) -> m.Mesh | None:
            if name not in live.faults or (only is not None and live.faults[name] != only):
                return None
            return dataclasses.replace(
                live, faults={k: f for k, f in live.faults.items() if k != name}
            )

        return self._change(edit, timeout)

    def apply_mesh(self, mesh: m.Mesh, *, timeout: float = 10.0, source: Any = None) -> ApplyResult:
        """A new mesh file (tenants, endpoints, resilience...) that keeps the live traffic split:
        weights and `x-canary` pins of a service whose versions are unchanged belong to the
        weights API and rollouts, not to whatever the file said when it was written. `source`:
        the document `mesh` parsed from, which replicas keep in their store (needed there).
        The faults set at run time (`meshlm fault`) stay too while the new mesh can take them;
        each one dropped is logged with why."""

        def keep_split(live: m.Mesh) -> m.Mesh:
            # a host fault may name a registered host
            services = self.registry.overlay(mesh).services
            faults, dropped = carried_over(live.faults, mesh.faults, services)
            for why in dropped.values():
                log.warning("new mesh: run-time fault dropped: %s", why)
            new = dataclasses.replace(mesh, faults=faults)
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
                mine = self._live(self.isolation.overlay(new), counts)
                changed[:] = [mine != self._live(live, counts)]
            return new

        if self.replication is not None:
            r = self._change_replicated(noted, timeout, source)
        else:
            r = self._change_here(noted, timeout)
        return dataclasses.replace(r, changed=changed[-1]) if r and changed else r

    def _change_here(
        self, edit: Callable[[m.Mesh], m.Mesh | None], timeout: float
    ) -> ApplyResult | None:
        with self.mutating:
            mesh = edit(self.mesh)
            if mesh is None:
                return None
            version, nodes = self._stage(self.isolation.overlay(mesh))
        if timeout == 0:
            return ApplyResult(version=version, ok=False, missing=sorted(nodes))
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

    def check_desired(self, mesh: m.Mesh) -> None:
        """ValueError if a group with a connected sidecar cannot take `mesh`; stages nothing."""
        mesh = self._live(self.isolation.overlay(mesh), membership.inbound_sidecars(self.sync))
        self.cache.check(mesh, self.sync.live_groups())

    def stage_desired(self, mesh: m.Mesh) -> int:
        """Stage `mesh` (desired state, read from the store) with the isolation controller's
        routes over it; the new generation. The caller holds the mutation lock."""
        self._stage(self.isolation.overlay(mesh))
        return self.cache.generation

    def push_isolation(self) -> tuple[m.Mesh, ApplyResult] | None:
        """The isolation controller's routes, when they differ from the live ones."""
        with self.mutating:
            mesh = self.isolation.overlay(self.mesh)
            if mesh is self.mesh:
                return None
            version, nodes = self._stage(mesh)
        return mesh, self.wait_for_ack(version, nodes, timeout=10.0)

    def push_shares(self) -> None:
        """A sidecar joined or left: re-divide tenants' rate limits when any are divided."""
        with self.mutating:
            mesh = membership.overlay(self.mesh, membership.inbound_sidecars(self.sync))
            if mesh is not self.mesh and membership.shares_matter(mesh):
                self._stage(mesh)

    def push_registrations(self, *, timeout: float = 5.0) -> ApplyResult:
        """A host registered, changed health or left: stage the live mesh with the registry's
        hosts and wait for the affected sidecars. When a change staged meanwhile holds them
        already, wait for that one: a host deregistering must not drain before its callers
        hold its removal, whichever change carried it. Replicas: the registration was written to
        the store; stage the store's and wait until every replica's sidecars hold it."""
        if self.replication is not None:
            return self._push_registrations_replicated(timeout)
        with self.mutating:
            if self.registry.overlay(self.mesh) is not self.mesh:
                version, nodes = self._stage(self.mesh)
            else:
                version, nodes = make_version(self.incarnation, self.cache.generation), None
        if timeout == 0 and nodes is not None:  # as a change's: staged, nothing waited for
            return ApplyResult(version=version, ok=False, missing=nodes)
        return self.wait_for_ack(version, nodes, timeout=timeout)

    def _push_registrations_replicated(self, timeout: float) -> ApplyResult:
        revision = self.registry.written  # the newest written here: this change's or later
        try:
            self.replication.reload()
        except StoreError:  # the store did not answer: stage what this replica knows
            with self.mutating:
                self._stage(self.mesh)
        acked, errors, missing, lagging = self.replication.wait(revision, timeout)
        version = make_version(self.incarnation, self.cache.generation)
        return ApplyResult(version, not missing, acked, missing, errors, lagging, revision)

    def _live(self, mesh: m.Mesh, counts: Counter[str]) -> m.Mesh:
        """`mesh` with what the control plane sees live: inbound sidecars, registered hosts."""
        return self.registry.overlay(membership.overlay(mesh, counts))

    def _stage(self, mesh: m.Mesh) -> tuple[str, list[str]]:
        # Raises (nothing staged, nothing pushed) when a group with a connected sidecar cannot
        # take the mesh; groups of departed sidecars never veto (they are dropped).
        mesh = self._live(mesh, membership.inbound_sidecars(self.sync))
        gen = self.cache.stage(mesh, self.sync.live_groups())
        lagging_after = mesh.control_plane.lagging_after
        if lagging_after != self.sync.limits.lagging_after:
            self.sync.limits = dataclasses.replace(self.sync.limits, lagging_after=lagging_after)
        nodes = self._affected(gen)
        self.sync.track(gen, nodes)
        self._publish()
        return make_version(self.incarnation, gen), nodes

    def _affected(self, generation: int) -> list[str]:
        return self.sync.connected_in(set(self.cache.changed_groups(generation)))

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

    # -- views ----------------------------------------------------------------------------------
    def syncz(self) -> dict:
        out = self.sync.to_json()
        out["incarnation"] = self.incarnation
        out["generation"] = self.cache.generation
        out["registrations"] = self.registry.to_json()
        if self.registry.rejected:
            out["registrations_rejected"] = dict(self.registry.rejected)
        if self.replication is not None:
            out["replication"] = self.replication.status()
        return out

    def config_dump(self) -> dict:

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


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while n:
        n, r = divmod(n, 36)
        out = digits[r] + out
    return out or "0"

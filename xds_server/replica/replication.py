"""A control plane's desired state on a store, shared by its replicas.

Every replica serves its own sidecars from the same desired state: the mesh as last applied
(`mesh`: the document the mesh file parses from), the live edits over it (`live/<service>`:
weights, x-canary pins, endpoints, SLO actions), the faults in force (`faults`: the file's and
those set at run time) and the hosts registered on any replica
(`registrations/<host:port>`, written by xds_server/registry/store.py). A change taken by any
replica is a revision-checked transaction on those keys (a writer that read a stale value is
refused, re-reads and tries again); every replica watches them and restages when they move, and
re-lists now and then (a watch behind a link that drops packets stays silent).

A change returns once every sidecar holds it wherever it is connected: each replica publishes one
summary of its sidecars (`acks/<replica>`, bound to its lease, rewritten at most every
`publish_every` seconds: not one key per sidecar per push), naming for each sidecar the newest
store revision it ACKed, and the waiter reads them all.

When the store cannot be reached a replica keeps serving what it has (the last good config);
changes fail with StoreUnavailable until it answers again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from xds_server import mesh as m
from xds_server.mesh.faults import fault_doc
from xds_server.mesh.model import parse_endpoint
from xds_server.slo.quarantine import Isolation, SharedQuarantine
from xds_server.store import keys
from xds_server.store.base import (
    Check,
    Conflict,
    Delete,
    Entry,
    Fence,
    LeaseLost,
    Put,
    Store,
    StoreError,
    StoreUnavailable,
    Watch,
    encode,
)
from xds_server.store.documents import check_faults, check_live, faults_of, mesh_source
from xds_server.xds.sync import SyncStatus

log = logging.getLogger("meshlm.replica")
RELIST_EVERY = 5.0  # seconds between full re-reads, watch or not
BACKOFF_MIN, BACKOFF_MAX = 0.5, 10.0  # seconds before the watch loop tries again
_KEEP = 64  # (store revision, generation) pairs remembered for ACK summaries


def _desired_key(key: str) -> bool:
    """A key of the desired state (mesh, faults, live/<service>)."""
    return key in (keys.MESH, keys.FAULTS) or key.startswith(keys.LIVE)


def live_doc(svc: m.Service) -> dict[str, Any]:
    """What `live/<service>` holds: the parts of a service that change at run time."""
    return {
        "weights": dict(svc.route.weights),
        "pins": list(svc.route.pins) if svc.route.pins else None,
        "mirror": dataclasses.asdict(svc.route.mirror) if svc.route.mirror else None,
        "endpoints": {v: [str(e) for e in ver.endpoints] for v, ver in svc.versions.items()},
        "slo_state": {
            "shed_tenants": list(svc.slo_state.shed_tenants),
            "outlier_tightened": svc.slo_state.outlier_tightened,
        },
    }


def desired_mesh(source: Any, lives: dict[str, dict[str, Any]]) -> m.Mesh:
    """The mesh `source` parses to, with each service's live edits over it. MeshError names
    the key and field of a document that is wrong."""
    mesh = m.parse_mesh(source)
    for name, doc in lives.items():
        mesh = apply_live(mesh, name, doc)
    return mesh


def apply_live(mesh: m.Mesh, name: str, doc: Any) -> m.Mesh:
    """`mesh` with the live document of service `name` over it, checked as an admin request
    would be; MeshError names the key and field that is wrong."""
    key = keys.live(name)
    check_live(doc, key)
    svc = mesh.services.get(name)
    eps = doc["endpoints"]
    if svc is None or set(eps) != set(svc.versions):
        return mesh  # left from before a mesh whose versions differ
    try:
        versions = {
            v: dataclasses.replace(
                ver,
                endpoints=tuple(parse_endpoint(e, f"{key}.endpoints.{v}") for e in eps[v]),
            )
            for v, ver in svc.versions.items()
        }
        services = {**mesh.services, name: dataclasses.replace(svc, versions=versions)}
        mesh = dataclasses.replace(mesh, services=services).with_weights(name, doc["weights"])
        if doc.get("pins"):
            mesh = mesh.with_pins(name, *doc["pins"])
        if doc.get("mirror"):
            mesh = mesh.with_mirror(name, m.Mirror(**doc["mirror"]))
        slo = doc.get("slo_state") or {}
        shed, tightened = slo.get("shed_tenants") or (), slo.get("outlier_tightened", False)
        return mesh.with_slo_state(name, m.SloState(tuple(shed), tightened))
    except m.MeshError as e:
        raise e if str(e).startswith(key) else m.MeshError(f"{key}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise m.MeshError(f"{key}: not a live document ({e!r})") from None


class SharedRegistry(Protocol):
    """The registered hosts, kept on the store (xds_server/registry/store.py)."""

    def sync(self, entries: list[Entry], revision: int, mesh: m.Mesh) -> dict[str, str]:
        """Take `entries` (the registration keys, read at `revision`) as the registered
        hosts; the keys left out and why."""

    def overlay(self, mesh: m.Mesh) -> m.Mesh:
        """`mesh` with the registered hosts."""


class Staging(Protocol):
    """What a replica's link to the store needs of its control plane."""

    mutating: AbstractContextManager[Any]  # held while the desired state is read and staged
    sync: SyncStatus
    isolation: Isolation
    registry: SharedRegistry

    @property
    def mesh(self) -> m.Mesh: ...

    def check_desired(self, mesh: m.Mesh) -> None:
        """ValueError when a connected sidecar cannot take `mesh`."""

    def stage_desired(self, mesh: m.Mesh) -> int:
        """Stage `mesh`; the new generation."""


class Replication:
    """Ties one control plane (a replica) to the store. `start(cp)` before the ADS port opens."""

    def __init__(
        self,
        store: Store,
        replica_id: str,
        source: Any = None,
        *,
        publish_every: float = 0.1,
        lease_ttl: float = 10.0,
    ) -> None:
        """`source`: the mesh document to seed an empty store with (a replica joining a store
        that has a mesh takes the store's)."""
        keys.replica(replica_id)  # a valid path segment, or ValueError
        self.store, self.id, self.source = store, replica_id, source
        self.publish_every, self.lease_ttl = publish_every, lease_ttl
        self.revision = 0  # the store revision the staged state was read at
        self.error = ""  # the last store error, "" once it answers again
        self.rejected: dict[str, str] = {}  # key -> why its document was refused
        self.broken = ""  # why the watch loop failed, "" once it runs again
        self._good: dict[str, tuple[int, Any]] = {}  # key -> (revision, last good document)
        self._cp: Staging | None = None
        self._faults_left_out: dict[str, str] = {}
        self._revs: dict[str, int] = {}  # mesh/live key -> revision, as staged
        self._staged: list[tuple[int, int]] = []  # (store revision, cache generation)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch: Watch | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, cp: Staging) -> None:
        self._cp = cp
        self._seed()
        self.reload()
        # Quarantines are decided by any replica from its sidecars' access logs and shared.
        cp.isolation.share(SharedQuarantine(self.store))
        for target, name in ((self._follow, "watch"), (self._publish, "acks")):
            t = threading.Thread(target=target, name=f"replica-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.close()
        for t in self._threads:
            t.join(timeout=5)

    def status(self) -> dict[str, Any]:
        return {
            "replica": self.id,
            "revision": self.revision,
            "store_error": self.error,
            "rejected": dict(self.rejected),
            "watch_error": self.broken,
        }

    # -- desired state --------------------------------------------------------------------------
    def _seed(self) -> None:
        if self.store.get(keys.MESH) is not None:
            return
        if self.source is None:
            raise ValueError("the store holds no mesh yet: start this replica with a mesh file")
        ops: list[Put | Delete] = [Put(keys.MESH, encode({"source": self.source}))]
        mesh = m.parse_mesh(self.source)
        ops += [Put(keys.live(n), encode(live_doc(s))) for n, s in mesh.services.items()]
        with contextlib.suppress(Conflict):  # another replica seeded it first: take that one
            self.store.txn([Check(keys.MESH, revision=0)], ops)

    def reload(self) -> None:
        """Read the desired state and stage it when it moved since last staged. A document
        that is wrong is refused (logged with its key and field, named by status() until it is
        replaced) and its last good version stands in for it."""
        cp = self._cp
        entries, rev = self.store.list("")
        docs = {e.key: e for e in entries if _desired_key(e.key)}
        hosts = [e for e in entries if e.key.startswith(keys.REGISTRATIONS)]
        revs = {k: e.revision for k, e in docs.items()} | {e.key: e.revision for e in hosts}
        with cp.mutating:
            if revs == self._revs:
                self.revision = max(self.revision, rev)
                return
            self._revs = revs  # not again until it moves
            mesh, rejected = self._desired(docs)
            # Registered hosts are laid over whatever is staged (ControlPlane._live); a record
            # left out is the registry's to report, not a desired-state document refused.
            cp.registry.sync(hosts, rev, mesh if mesh is not None else cp.mesh)
            if mesh is not None:
                try:
                    gen = cp.stage_desired(mesh)
                except ValueError as e:  # a connected sidecar cannot take it
                    rejected["(desired state)"] = str(e)
                    mesh = None
            for key, why in rejected.items():
                if self.rejected.get(key) != why:
                    log.error("replica %s: store revision %d: %s refused: %s (keeping its "
                              "last good version)", self.id, rev, key, why)  # fmt: skip
            self.rejected = rejected
            if mesh is None:
                return
            self.revision = rev
            self._remember(rev, gen)
        log.info("replica %s: staged store revision %d", self.id, rev)

    def _desired(self, docs: dict[str, Entry]) -> tuple[m.Mesh | None, dict[str, str]]:
        """The desired mesh from `docs` (None: no good mesh document ever), and the documents
        refused: key -> why. Each refused document's last good version is used instead."""
        rejected: dict[str, str] = {}
        good: dict[str, tuple[int, Any]] = {}
        for key, e in docs.items():
            known = self._good.get(key)
            if known is not None and known[0] == e.revision:
                good[key] = known
                continue
            try:
                doc = e.json()
                if key == keys.MESH:
                    m.parse_mesh(mesh_source(doc, key))
                elif key == keys.FAULTS:
                    check_faults(doc, key)
                else:
                    check_live(doc, key)
                good[key] = (e.revision, doc)
            except (ValueError, RecursionError) as err:  # MeshError is a ValueError
                rejected[key] = str(err) if str(err).startswith(key) else f"{key}: {err}"
                if known is not None:
                    good[key] = known
        if keys.MESH not in good:
            rejected.setdefault(keys.MESH, f"{keys.MESH}: absent")
            return None, rejected
        mesh = m.parse_mesh(good[keys.MESH][1]["source"])
        for key in sorted(k for k in good if k.startswith(keys.LIVE)):
            candidates = [good[key]]
            if key in self._good and self._good[key] != good[key]:
                candidates.append(self._good[key])
            for i, (revision, doc) in enumerate(candidates):
                try:
                    mesh = apply_live(mesh, key.removeprefix(keys.LIVE), doc)
                except ValueError as err:  # MeshError, or a key no service can have
                    if i == 0:
                        rejected[key] = str(err)
                    continue
                good[key] = (revision, doc)
                break
            else:
                del good[key]
        if keys.FAULTS in good:
            # Checked against the registered hosts too: a host fault may name one.
            services = self._cp.registry.overlay(mesh).services
            faults, refused = faults_of(good[keys.FAULTS][1], keys.FAULTS, services)
            mesh = dataclasses.replace(mesh, faults=faults)
            # Left out alone and logged, not refused: a fault whose host left is no reason to
            # say this replica is not ready.
            for name, why in refused.items():
                if self._faults_left_out.get(name) != why:
                    log.warning("replica %s: fault %s left out: %s", self.id, name, why)
            self._faults_left_out = refused
        self._good = good
        return mesh, rejected

    def change(
        self,
        edit: Callable[[m.Mesh], m.Mesh | None],
        *,
        source: Any = None,
        fence: Fence | None = None,
        attempts: int = 8,
        retry_for: float = 5.0,
    ) -> tuple[int, int] | None:
        """Write `edit(desired mesh)` (and `source`, the new mesh document, if given) to the
        store at the revisions it was read at, staging it here; (store revision, generation),
        or None when the edit changes nothing. Retries on a conflict with what others wrote;
        raises Fenced for a `fence` whose term ended, StoreUnavailable when the store did not
        answer for `retry_for` seconds (the write may have landed: the next reload shows)."""
        deadline, conflicts = time.monotonic() + retry_for, 0
        while True:
            try:
                done = self._write(edit, source, fence)
            except StoreUnavailable:
                # An etcd leader election takes a second or two: try again (the revision
                # checks make that safe, and a reload shows a write that did land).
                if time.monotonic() >= deadline or self._stop.wait(0.2):
                    raise
                with contextlib.suppress(StoreError):
                    self.reload()
                continue
            if not isinstance(done, Conflict):
                return done
            conflicts += 1
            if conflicts >= attempts:
                raise done
            log.info("replica %s: %s; reading again", self.id, done)
            self.reload()  # restages what the store holds

    def _write(
        self, edit: Callable[[m.Mesh], m.Mesh | None], source: Any, fence: Fence | None
    ) -> tuple[int, int] | Conflict | None:
        """One try of `change`: the Conflict (other than the fence's) is returned, not raised."""
        cp = self._cp
        with cp.mutating:
            base = cp.mesh
            new = edit(base)
            if new is None:
                return None
            checks, ops = self._writes(base, new, source)
            checks = ([fence.check()] if fence else []) + checks
            cp.check_desired(new)  # ValueError: nothing written
            try:
                rev = self.store.txn(checks, ops)
            except Conflict as e:
                if fence is not None and e.key == fence.key:
                    raise
                return e
            except StoreError:
                self._revs = {}  # it may or may not have landed: the next reload says
                raise
            # Staged only once written: sidecars never see what the store refused.
            gen = cp.stage_desired(new)
            for op in ops:
                if isinstance(op, Put):
                    self._revs[op.key] = rev
                else:
                    self._revs.pop(op.key, None)
            self.revision = rev
            self._remember(rev, gen)
            return rev, gen

    def _writes(self, base: m.Mesh, new: m.Mesh, source: Any) -> tuple[list[Check], list]:
        checks, ops = [], []

        def write(key: str, op: Put | Delete) -> None:
            checks.append(Check(key, revision=self._revs.get(key, 0)))
            ops.append(op)

        if source is not None:
            write(keys.MESH, Put(keys.MESH, encode({"source": source})))
            for key in self._revs:
                if key.startswith(keys.LIVE) and key.removeprefix(keys.LIVE) not in new.services:
                    write(key, Delete(key))
        if source is not None or new.faults != base.faults:
            doc = {"faults": [fault_doc(f) for f in new.faults.values()]}
            write(keys.FAULTS, Put(keys.FAULTS, encode(doc)))
        for name, svc in new.services.items():
            doc = live_doc(svc)
            old = base.services.get(name)
            if source is None and old is not None and live_doc(old) == doc:
                continue
            write(keys.live(name), Put(keys.live(name), encode(doc)))
        return checks, ops

    def _remember(self, rev: int, gen: int) -> None:
        self._staged.append((rev, gen))
        del self._staged[:-_KEEP]

    def _follow(self) -> None:
        """Watch the store; reload on a change of the desired state and every RELIST_EVERY.
        Never ends before stop(): an unexpected error is logged, named by status() (readiness
        says so) and the loop starts over after a pause that grows to BACKOFF_MAX."""
        next_list = time.monotonic() + RELIST_EVERY
        pause = BACKOFF_MIN
        while not self._stop.is_set():
            try:
                if self._watch is None:
                    self.reload()
                    self._watch = self.store.watch("", self.revision + 1)
                    next_list = time.monotonic() + RELIST_EVERY
                ev = self._watch.get(timeout=max(0.05, next_list - time.monotonic()))
                moved = ev is not None and (
                    _desired_key(ev.key) or ev.key.startswith(keys.REGISTRATIONS)
                )
                if moved or time.monotonic() >= next_list:
                    self.reload()
                    next_list = time.monotonic() + RELIST_EVERY
                self._ok()
                if self.broken:
                    log.warning("replica %s: the store watch runs again", self.id)
                    self.broken = ""
                pause = BACKOFF_MIN
                continue
            except StoreError as e:
                if self._stop.is_set():
                    return
                self._failed(e)
                pause = BACKOFF_MIN  # the store's own deadline paced it already
            except Exception as e:  # a bug or a value nothing expected: never die of it
                why = f"{type(e).__name__}: {str(e)[:300]}"
                if why != self.broken:
                    log.exception("replica %s: store watch failed (serving the last good "
                                  "config; trying again)", self.id)  # fmt: skip
                self.broken = why
                self._revs = {}  # read everything again next time
            if self._watch is not None:
                self._watch.close()
                self._watch = None
            self._stop.wait(pause)
            if self.broken:
                pause = min(BACKOFF_MAX, pause * 2)

    # -- ACKs across replicas -------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """This replica's sidecars: for each connected one the newest store revision it ACKed
        and its state at the newest one staged (acked, pending, nacked, lagging)."""
        sync = self._cp.sync
        with sync.cond:
            nodes = [nid for nid, ns in sync.nodes.items() if ns.connected]
        staged = list(self._staged)
        out = {}
        for nid in nodes:
            rev, state, error = 0, "pending", ""
            for i, (r, g) in enumerate(reversed(staged)):
                st, err = sync.state(nid, g)
                if i == 0:
                    state, error = st, err
                if st == "acked":
                    rev = r
                    break
            out[nid] = {"revision": rev, "state": state, "error": error[:200]}
        return {"revision": self.revision, "nodes": out}

    def _publish(self) -> None:
        key, lease, last, beat = keys.ACKS + self.id, 0, None, 0.0
        looked: tuple = ()
        look_again = 0.0
        while not self._stop.wait(self.publish_every):
            try:
                now = time.monotonic()
                if not lease:
                    lease, last, beat = self.store.grant(self.lease_ttl), None, now
                    looked = ()
                elif now - beat >= self.lease_ttl / 3:
                    self.store.keepalive(lease)
                    beat = now
                # Lagging is a matter of time alone: look again each second regardless.
                seen = (self._cp.sync.changes, self.revision, self._staged[-1:])
                if seen == looked and now < look_again:
                    continue
                looked, look_again = seen, now + 1.0
                doc = self.summary()
                if doc != last:
                    self.store.txn([], [Put(key, encode(doc), lease)])
                    last = doc
                self._ok()
            except LeaseLost:
                lease = 0
            except StoreError as e:
                self._failed(e)
        if lease:
            with contextlib.suppress(StoreError):
                self.store.revoke(lease)

    def wait(self, revision: int, timeout: float) -> tuple[list, dict, list, list]:
        """Until every sidecar of every replica holds `revision` (or NACKed it, or lags), or
        `timeout`: (acked, errors, missing, lagging) as SyncStatus.wait gives them."""
        end = time.monotonic() + timeout
        while True:
            states: dict[str, tuple[int, str, str]] = {}  # node -> (revision, state, error)
            notes: list[str] = []
            try:
                entries, _ = self.store.list(keys.ACKS)
                docs = {e.key.removeprefix(keys.ACKS): e.json() for e in entries}
            except StoreError as e:
                docs, notes = {}, [f"(store: {e})"]
            if self.id not in docs:
                notes.append(f"(replica {self.id}: no ACK summary yet)")
            for replica, doc in sorted(docs.items()):
                at = doc.get("revision", 0)
                if at < revision and not doc.get("nodes"):
                    notes.append(f"(replica {replica}: at revision {at})")
                for node, st in doc.get("nodes", {}).items():
                    state = st["state"] if at >= revision else "pending"
                    # A sidecar that moved to another replica is in two summaries until the
                    # old one's lease ends: the newest word wins.
                    if node not in states or st["revision"] > states[node][0]:
                        states[node] = (st["revision"], state, st.get("error", ""))
            acked = sorted(n for n, (r, _, _) in states.items() if r >= revision)
            lagging = sorted(
                n for n, (r, s, _) in states.items() if r < revision and s == "lagging"
            )
            errors = {n: e for n, (r, s, e) in states.items() if r < revision and s == "nacked"}
            missing = sorted(n for n in states if n not in acked and n not in lagging) + notes
            settled = all(n in errors for n in missing)
            if settled or time.monotonic() >= end:
                return acked, errors, missing, lagging
            time.sleep(0.05)

    def _ok(self) -> None:
        if self.error:
            log.warning("replica %s: the store answers again", self.id)
            self.error = ""

    def _failed(self, e: StoreError) -> None:
        if str(e) != self.error:
            log.warning("replica %s: store: %s (serving the last good config)", self.id, e)
        self.error = str(e)

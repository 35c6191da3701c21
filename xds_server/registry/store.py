"""Registrations shared by control-plane replicas on a store: one key per host,
`registrations/<host:port>` (store/keys.py), holding its record (registry/record.py).

The replica that holds a host's stream writes its key, revision-checked (a replica never
overwrites a registration it did not read), bound to that replica's registration lease: one
lease per replica with a TTL of the grace period, kept alive while the replica lives. A stream
that ends unannounced moves its key to a lease of its own with the same TTL that nobody renews,
so the host leaves a grace period later unless it registers again; a replica that dies takes its
lease with it, so its hosts leave a grace period after its last keep-alive unless they register
again elsewhere. A host whose stream moves to another replica takes its key over in one
revision-checked write: the key is never absent, so callers never lose it. A replica cut off from
the store for longer than the grace period cannot renew its lease, so its hosts leave (nobody
vouches for them); once it reaches the store again it writes the hosts of the streams still open
on it again, on a new lease. The lease's TTL is the grace period when it was granted.

Every replica reads the keys with the rest of the desired state (replica/replication.py watches
the store and calls `sync` before it stages), so every replica lays the same hosts over the
mesh and serves the same EDS; each stages its own sidecars, as for any change of the store.
The limits (max_total, max_per_service) are checked against the store's keys read just before
a new host's key is written.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import grpc

from xds_server import mesh as m
from xds_server.registry.record import from_record, to_record
from xds_server.registry.request import Refused, Register
from xds_server.registry.table import (
    Entry,
    Registry,
    check_limits,
    check_static,
    check_takeover,
)
from xds_server.store import keys
from xds_server.store.base import (
    Check,
    Conflict,
    Delete,
    LeaseLost,
    Put,
    Store,
    StoreError,
    encode,
)

log = logging.getLogger("meshlm.registry")
ATTEMPTS = 5  # writes of one registration that found the key changed under them
TICK = 0.1  # seconds between the keeper's rounds


class StoreRegistry(Registry):
    """The registry of one replica: what it writes goes to the store first; what it lays over
    the mesh is the store's (`sync`) with its own newer writes."""

    def __init__(
        self,
        store: Store,
        replica_id: str,
        mesh: Callable[[], m.Mesh],
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(clock)
        self.blocking = True
        self.store, self.replica = store, replica_id
        self._mesh = mesh
        self._mine: dict[int, tuple[m.Endpoint, int]] = {}  # token -> (address, revision written)
        # token -> the entry of each stream open here: what to write again if the lease ends
        self._streams: dict[int, Entry] = {}
        self._leaving: dict[int, float] = {}  # token -> when its stream was lost (to write)
        # address -> revision of its deletion here: a read older than that must not bring the
        # host back (a deregistered host would take calls again while it drains)
        self._gone: dict[m.Endpoint, int] = {}
        self._lease, self._lease_ttl, self._beat = 0, 0, 0.0
        self._lease_ended = False  # the keys on it went with it: write the open ones again
        self._lease_lock = threading.Lock()
        self.written = 0  # the newest store revision written here
        self._stop = threading.Event()
        self._keeper = threading.Thread(target=self._keep, name="registry-lease", daemon=True)
        self._keeper.start()

    # -- the registration service's changes ---------------------------------------------------
    def add(self, reg: Register, *, token: int, spiffe_id: str | None, mesh: m.Mesh) -> Entry:
        check_static(mesh, reg)
        key = keys.registration(str(reg.endpoint))
        for _ in range(ATTEMPTS):
            try:
                cur = self.store.get(key)
                old = self._read(cur, mesh)
                check_takeover(old, reg, spiffe_id)
                if cur is None:
                    check_limits(mesh, reg, self._services())
                entry = Entry(token, reg, spiffe_id, self._clock(), reg.serving)
                lease = self._lease_for(mesh.control_plane.registration.grace)
                rev = self.store.put(
                    key, self._value(entry), revision=cur.revision if cur else 0, lease=lease
                )
            except Conflict:
                continue  # another replica wrote it meanwhile: read it again
            except LeaseLost:
                self._drop_lease()
                continue
            except StoreError as e:
                raise _unavailable("register", e) from None
            with self._lock:
                for t, (address, _) in list(self._mine.items()):
                    if address == reg.endpoint:  # this host's earlier stream here
                        self._forget_locked(t)
                self._mine[token] = (reg.endpoint, rev)
                self._streams[token] = entry
                self._by_address[reg.endpoint] = entry
                self.written = max(self.written, rev)
            return entry
        raise Refused(
            grpc.StatusCode.ABORTED,
            f"register: {key} changed under this registration {ATTEMPTS} times; try again",
        )

    def set_health(self, token: int, healthy: bool) -> Entry | None:
        entry, rev = self._own(token)
        if entry is None:
            self._forget(token)  # its key is gone or another's: the stream ends
            return None
        if entry.healthy == healthy:
            return entry
        entry = replace(entry, healthy=healthy)
        grace = self._mesh().control_plane.registration.grace
        try:
            rev = self.store.put(
                _key(entry), self._value(entry), revision=rev, lease=self._lease_for(grace)
            )
        except Conflict:
            self._forget(token)  # taken over on another stream
            return None
        except StoreError as e:
            raise _unavailable("health", e) from None
        self._wrote(token, entry, rev)
        return entry

    def remove(self, token: int) -> Entry | None:
        entry, rev = self._own(token)
        if entry is None:
            self._forget(token)
            return None
        try:
            done = self.store.delete(_key(entry), revision=rev)
        except Conflict:
            self._forget(token)
            return None
        except StoreError as e:
            raise _unavailable("deregister", e) from None
        with self._lock:
            self._forget_locked(token)
            if self._by_address.get(entry.reg.endpoint) is entry:
                del self._by_address[entry.reg.endpoint]
            self._gone[entry.reg.endpoint] = done
            self.written = max(self.written, done)
        return entry

    def lose(self, token: int) -> Entry | None:
        """Marked lost here at once; the keeper moves its key to a lease nobody renews."""
        with self._lock:
            self._streams.pop(token, None)
            entry = self._owned(token)
            if entry is None or token not in self._mine or entry.lost_at is not None:
                return entry
            entry = replace(entry, lost_at=self._clock())
            self._by_address[entry.reg.endpoint] = entry
            self._leaving[token] = entry.lost_at
        return entry

    def expire(self, token: int) -> Entry | None:
        """Nothing to do here: the key's lease ends by itself (every replica sees it go)."""
        return None

    def close(self) -> None:
        """Stop renewing: this replica's hosts leave a grace period from now unless they
        register again on another replica (their sidecars reconnect there)."""
        super().close()
        self._stop.set()
        self._keeper.join(timeout=5)

    # -- the store's view, read by the replica's watch -----------------------------------------
    def sync(self, entries: Sequence, revision: int, mesh: m.Mesh) -> dict[str, str]:
        """Take the keys `entries` (read at store `revision`) as the registered hosts, keeping
        this replica's writes newer than that; the records left out: key -> why."""
        limit = mesh.control_plane.registration.max_total
        rejected: dict[str, str] = {}
        with self._lock:
            mine = {(a, r): t for t, (a, r) in self._mine.items()}
            new: dict[m.Endpoint, Entry] = {}
            for e in sorted(entries, key=lambda e: e.created):
                try:
                    address = m.parse_endpoint(e.key.removeprefix(keys.REGISTRATIONS), e.key)
                    doc = e.json()
                    if not _known(doc, mesh):
                        continue  # a version the mesh no longer has: laid over nothing
                    entry = from_record(doc, mesh, mine.get((address, e.revision), 0), e.key)
                    if entry.reg.endpoint != address:
                        raise ValueError(f"{e.key}.address: {entry.reg.endpoint}, not its key's")
                except ValueError as err:  # MeshError is one
                    rejected[e.key] = str(err)
                    continue
                if self._gone.get(address, 0) > revision:
                    continue  # deleted here since that read
                if len(new) >= limit:
                    rejected[e.key] = f"{e.key}: over control_plane.registration.max_total"
                    continue
                if entry.token in self._leaving:
                    entry = replace(entry, lost_at=self._leaving[entry.token])
                new[address] = entry
            for t, (address, rev) in list(self._mine.items()):
                if rev > revision:  # written here after that read: it stands
                    if address in self._by_address:
                        new[address] = self._by_address[address]
                elif new.get(address) is None:
                    self._mine.pop(t, None)  # deleted or expired (written again if its lease
                    self._leaving.pop(t, None)  # ended under an open stream: _rewrite_open)
                elif new[address].token != t:
                    self._forget_locked(t)  # taken over elsewhere
            self._by_address = new
            self._gone = {a: r for a, r in self._gone.items() if r > revision}
        for key, why in rejected.items():
            if self.rejected.get(key) != why:
                log.error("registration %s left out: %s", key, why)
        self.rejected = rejected
        return rejected

    # -- the leases -----------------------------------------------------------------------------
    def _lease_for(self, grace: float) -> int:
        """This replica's registration lease (granted on first use, TTL the grace period)."""
        with self._lease_lock:
            if not self._lease:
                self._lease_ttl = max(1, math.ceil(grace))
                self._lease = self.store.grant(self._lease_ttl)
                self._beat = time.monotonic()
            return self._lease

    def _drop_lease(self) -> None:
        """The lease ended (the store unreachable longer than its TTL): the keepers writes
        the hosts of the streams open here again, on a new one."""
        with self._lease_lock:
            if self._lease:
                log.warning("replica %s: its registration lease ended; writing its hosts again",
                            self.replica)  # fmt: skip
            self._lease, self._lease_ended = 0, True

    def _keep(self) -> None:
        """Renew the lease every third of its TTL; move lost hosts to leases of their own;
        when the lease was lost (the store unreachable longer than its TTL), write this
        replica's open hosts again on a new one."""
        while not self._stop.wait(TICK):
            try:
                self._renew()
                if self._lease_ended:
                    self._lease_ended = False
                    try:
                        self._rewrite_open()
                    except StoreError:
                        self._lease_ended = True
                        raise
                self._move_lost()
            except StoreError as e:
                log.warning("replica %s: registrations: store: %s (trying again)", self.replica, e)
                self._stop.wait(1.0)
            except Exception:  # never die of a bug: the leases would end
                log.exception("replica %s: registration lease keeper failed", self.replica)
                self._stop.wait(1.0)

    def _renew(self) -> None:
        with self._lease_lock:
            lease, ttl, beat = self._lease, self._lease_ttl, self._beat
        if not lease or time.monotonic() - beat < ttl / 3:
            return
        try:
            self.store.keepalive(lease)
        except LeaseLost:
            self._drop_lease()
            return
        with self._lease_lock:
            self._beat = time.monotonic()

    def _rewrite_open(self) -> None:
        """The keys of the streams open here, gone with the lease: written again (a key
        another replica wrote meanwhile is that replica's now)."""
        grace = self._mesh().control_plane.registration.grace
        with self._lock:
            streams = dict(self._streams)
            mine = dict(self._mine)
        for token, entry in streams.items():
            key = _key(entry)
            cur = self.store.get(key)
            if cur is not None:
                if mine.get(token, (None, 0))[1] != cur.revision:
                    self._forget(token)  # registered again elsewhere meanwhile
                continue
            try:
                rev = self.store.put(key, self._value(entry), revision=0,
                                     lease=self._lease_for(grace))  # fmt: skip
            except Conflict:
                self._forget(token)
                continue
            with self._lock:
                if token in self._streams:
                    self._mine[token] = (entry.reg.endpoint, rev)
                    self._by_address[entry.reg.endpoint] = self._streams[token]
                self.written = max(self.written, rev)

    def _move_lost(self) -> None:
        grace = self._mesh().control_plane.registration.grace
        with self._lock:
            leaving = [(t, self._mine.get(t), self._by_address) for t in self._leaving]
        for token, mine, table in leaving:
            if mine is None:
                with self._lock:
                    self._leaving.pop(token, None)
                continue
            address, rev = mine
            entry = table.get(address)
            if entry is None or entry.token != token:
                self._forget(token)
                continue
            key = _key(entry)
            if self._clock() - self._leaving[token] >= grace:
                ops = [Delete(key)]  # not moved in its grace period: it goes now
            else:
                ops = [Put(key, self._value(entry), self.store.grant(max(1, math.ceil(grace))))]
            try:
                done = self.store.txn([Check(key, revision=rev)], ops)
            except Conflict:
                self._forget(token)  # registered again, here or elsewhere
                continue
            with self._lock:
                self._forget_locked(token)  # its lease is nobody's now: the store ends it
                if isinstance(ops[0], Delete):
                    self._by_address.pop(address, None)
                    self._gone[address] = done
                self.written = max(self.written, done)

    # -- helpers --------------------------------------------------------------------------------
    def _services(self) -> list[str]:
        """The service of each host the store holds now (what the limits count)."""
        entries, _ = self.store.list(keys.REGISTRATIONS)
        out = []
        for e in entries:
            with contextlib.suppress(ValueError):
                doc = e.json()
                out.append(doc.get("service") if isinstance(doc, dict) else None)
        return out

    def _read(self, cur, mesh: m.Mesh) -> Entry | None:
        """The entry at a key before a write (None: absent, or a record that is not one, which
        any registration may replace)."""
        if cur is None:
            return None
        try:
            return from_record(cur.json(), mesh, 0, cur.key)
        except ValueError:
            return None

    def _value(self, entry: Entry) -> bytes:
        return encode(to_record(entry, self.replica))

    def _own(self, token: int) -> tuple[Entry | None, int]:
        with self._lock:
            mine = self._mine.get(token)
            entry = self._by_address.get(mine[0]) if mine else None
        if mine is None or entry is None or entry.token != token:
            return None, 0
        return entry, mine[1]

    def _wrote(self, token: int, entry: Entry, rev: int) -> None:
        with self._lock:
            if token in self._mine:
                self._mine[token] = (entry.reg.endpoint, rev)
                self._by_address[entry.reg.endpoint] = entry
                if token in self._streams:
                    self._streams[token] = entry
            self.written = max(self.written, rev)

    def _forget(self, token: int) -> None:
        with self._lock:
            self._forget_locked(token)

    def _forget_locked(self, token: int) -> None:
        self._mine.pop(token, None)
        self._leaving.pop(token, None)
        self._streams.pop(token, None)


def _known(doc: object, mesh: m.Mesh) -> bool:
    """Whether a record names a service and version of `mesh` (the rest is checked after)."""
    if not isinstance(doc, dict):
        return True
    svc = mesh.services.get(doc.get("service")) if isinstance(doc.get("service"), str) else None
    return svc is not None and doc.get("version") in svc.versions


def _key(entry: Entry) -> str:
    return keys.registration(str(entry.reg.endpoint))


def _unavailable(what: str, e: StoreError) -> Refused:
    return Refused(
        grpc.StatusCode.UNAVAILABLE, f"{what}: the state store did not answer ({e}); try again"
    )

"""The live registrations: one per address, each owned by the stream that made it.

Bounded: at most `max_per_service` per service and `max_total` in all (a registration that
lost its stream counts until its grace period ends). An address is one host: it cannot be
registered twice, nor registered when the mesh file lists it. A stream that ended unannounced
leaves its host in place, marked lost, until `grace` passes (the sidecar reconnecting in that
time takes it back); a deregistration removes it at once.

With a `journal` (registry/journal.py) every change is saved, and the hosts read back after a
restart are held as lost for the grace period (`restore`): callers keep them while their
sidecars register again. Replicas on a store keep the table there (registry/store.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import grpc

from xds_server import mesh as m
from xds_server.registry.request import Refused, Register

log = logging.getLogger("meshlm.registry")


@dataclass(frozen=True)
class Entry:
    """One registered host and the stream (`token`) that owns it."""

    token: int
    reg: Register
    spiffe_id: str | None
    since: float  # unix time of the registration
    healthy: bool
    lost_at: float | None = None  # unix time its stream ended unannounced

    def to_json(self) -> dict[str, Any]:
        r = self.reg
        return {
            "address": str(r.endpoint),
            "service": r.service,
            "version": r.version,
            "zone": r.zone,
            "weight": r.weight,
            "node": r.node_id,
            "spiffe_id": self.spiffe_id,
            "since": self.since,
            "since_iso": _iso(self.since),
            "health": "SERVING" if self.healthy else "NOT_SERVING",
            "stream": "lost" if self.lost_at is not None else "open",
            "lost_at": self.lost_at,
        }


class Journal(Protocol):
    """Where a registry's entries are saved on every change (registry/journal.py)."""

    def save(self, entries: Sequence[Entry]) -> None:
        """Save `entries` soon (never blocks: called under the registry's lock)."""

    def close(self) -> None:
        """Save what `save` was given last, now; nothing after."""


class Registry:
    """Thread-safe: the registration streams write it, the control plane reads it when it
    stages a change. `blocking`: its changes wait on I/O (a store's), so the registration
    service makes them off its event loop."""

    def __init__(
        self, clock: Callable[[], float] = time.time, journal: Journal | None = None
    ) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._by_address: dict[m.Endpoint, Entry] = {}
        self.refused = 0
        self.rejected: dict[str, str] = {}  # a record kept outside that was left out -> why
        self.blocking = False
        self._journal = journal
        self._timers: list[threading.Timer] = []
        self._closed = False

    def add(self, reg: Register, *, token: int, spiffe_id: str | None, mesh: m.Mesh) -> Entry:
        """Register `reg` for the stream `token`; Refused when the address is taken (the mesh
        file's, or another live host's) or a limit of `mesh.control_plane.registration` is
        reached. The same node re-registering (a reconnect) takes its registration over."""
        check_static(mesh, reg)
        with self._lock:
            old = self._by_address.get(reg.endpoint)
            check_takeover(old, reg, spiffe_id)
            if old is None:
                check_limits(mesh, reg, [e.reg.service for e in self._by_address.values()])
            entry = Entry(token, reg, spiffe_id, self._clock(), reg.serving)
            self._by_address[reg.endpoint] = entry
        self._changed()
        return entry

    def set_health(self, token: int, healthy: bool) -> Entry | None:
        """The stream `token`'s host is (not) serving; None when that stream owns none (taken
        over by a newer registration)."""
        with self._lock:
            entry = self._owned(token)
            changed = entry is not None and entry.healthy != healthy
            if changed:
                entry = replace(entry, healthy=healthy)
                self._by_address[entry.reg.endpoint] = entry
        if changed:
            self._changed()
        return entry

    def remove(self, token: int) -> Entry | None:
        """Deregistration: the stream `token`'s host goes at once."""
        with self._lock:
            entry = self._owned(token)
            if entry is not None:
                del self._by_address[entry.reg.endpoint]
        if entry is not None:
            self._changed()
        return entry

    def lose(self, token: int) -> Entry | None:
        """The stream `token` ended unannounced: its host is marked lost (see `expire`)."""
        with self._lock:
            entry = self._owned(token)
            changed = entry is not None and entry.lost_at is None
            if changed:
                entry = replace(entry, lost_at=self._clock())
                self._by_address[entry.reg.endpoint] = entry
        if changed:
            self._changed()
        return entry

    def expire(self, token: int) -> Entry | None:
        """The grace period of the stream `token` ended: its host goes, unless a new stream
        took it over."""
        with self._lock:
            entry = self._owned(token)
            if entry is None or entry.lost_at is None:
                return None
            del self._by_address[entry.reg.endpoint]
        self._changed()
        return entry

    def restore(
        self, entries: Sequence[Entry], mesh: m.Mesh, expired: Callable[[], object]
    ) -> list[Entry]:
        """Hosts read back after a restart, held as lost for the mesh's grace period: a host
        that registers again in that time takes its entry over, the rest then go and
        `expired()` restages without them. Within the limits; the entries held."""
        now = self._clock()
        held = []
        with self._lock:
            for i, e in enumerate(entries, 1):
                if e.reg.endpoint in self._by_address or _static_owner(mesh, e.reg.endpoint):
                    continue
                try:
                    check_limits(mesh, e.reg, [h.reg.service for h in self._by_address.values()])
                except Refused as r:
                    log.warning("registration of %s not restored: %s", e.reg.endpoint, r.message)
                    continue
                entry = replace(e, token=-i, lost_at=now)  # no stream has a negative token
                self._by_address[e.reg.endpoint] = entry
                held.append(entry)
        if held:
            log.warning(
                "%d registrations restored (%s): held for %gs for their hosts to register again",
                len(held),
                ", ".join(str(e.reg.endpoint) for e in held[:10])
                + (" ..." if len(held) > 10 else ""),
                mesh.control_plane.registration.grace,
            )
            timer = threading.Timer(
                mesh.control_plane.registration.grace,
                self._expire_restored,
                ([e.token for e in held], expired),
            )
            timer.daemon = True
            self._timers.append(timer)
            timer.start()
        return held

    def _expire_restored(self, tokens: list[int], expired: Callable[[], object]) -> None:
        gone = [e for t in tokens if (e := self.expire(t)) is not None]
        for e in gone:
            log.warning(
                "registration of %s (node %s), held since the restart, expired: it did not "
                "register again",
                e.reg.endpoint,
                e.reg.node_id,
            )
        if gone and not self._closed:
            try:
                expired()
            except ValueError as e:  # a sidecar group that cannot take the mesh
                log.warning("registration change not staged: %s", e)

    def close(self) -> None:
        """Stop holding and saving (the process stops), the last change saved."""
        self._closed = True
        for t in self._timers:
            t.cancel()
        if self._journal is not None:
            self._journal.close()

    def _changed(self) -> None:
        """Hand the entries as they are now to the journal (in order: under the lock)."""
        if self._journal is None:
            return
        with self._lock:
            self._journal.save(list(self._by_address.values()))

    def _owned(self, token: int) -> Entry | None:
        for entry in self._by_address.values():
            if entry.token == token:
                return entry
        return None

    def overlay(self, mesh: m.Mesh) -> m.Mesh:
        """`mesh` with every version's registered hosts (the same Mesh when they are already
        so)."""
        with self._lock:
            entries = sorted(self._by_address.values(), key=lambda e: e.since)
        hosts: dict[tuple[str, str], list[m.RegisteredEndpoint]] = {}
        for e in entries:
            r = e.reg
            hosts.setdefault((r.service, r.version), []).append(
                m.RegisteredEndpoint(r.endpoint, r.zone, r.weight, e.healthy)
            )
        return mesh.with_registered({k: tuple(v) for k, v in hosts.items()})

    def to_json(self) -> list[dict[str, Any]]:
        with self._lock:
            entries = list(self._by_address.values())
        rows = [e.to_json() for e in entries]
        return sorted(rows, key=lambda r: (r["service"], r["version"], r["address"]))

    def __len__(self) -> int:
        return len(self._by_address)


def check_static(mesh: m.Mesh, reg: Register) -> None:
    """Refused when the mesh file lists the address."""
    static = _static_owner(mesh, reg.endpoint)
    if static:
        raise Refused(
            grpc.StatusCode.ALREADY_EXISTS,
            f"register.address: {reg.endpoint} is a static endpoint of {static}",
        )


def check_takeover(old: Entry | None, reg: Register, spiffe_id: str | None) -> None:
    """Refused when another host holds the address (`old`) and `reg` may not take it over."""
    if old is not None and not _takes_over(old, reg, spiffe_id):
        raise Refused(
            grpc.StatusCode.ALREADY_EXISTS,
            f"register.address: {reg.endpoint} is registered already, by node "
            f"{old.reg.node_id!r} for {old.reg.service}/{old.reg.version}",
        )


def check_limits(mesh: m.Mesh, reg: Register, services: Sequence[str]) -> None:
    """Refused when one more host for `reg.service` would pass a limit, `services` being the
    service of each host registered now."""
    limits = mesh.control_plane.registration
    mine = sum(s == reg.service for s in services)
    if mine >= limits.max_per_service:
        raise Refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"register.service: {reg.service} has {mine} registered hosts, the most "
            f"control_plane.registration.max_per_service allows",
        )
    if len(services) >= limits.max_total:
        raise Refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"register: {len(services)} registered hosts, the most "
            f"control_plane.registration.max_total allows",
        )


def _takes_over(old: Entry, reg: Register, spiffe_id: str | None) -> bool:
    """A reconnecting sidecar takes its own registration over: the same node for the same
    service and version with the same identity, or anyone of them once the old stream was
    lost."""
    same = (old.reg.service, old.reg.version, old.spiffe_id) == (
        reg.service,
        reg.version,
        spiffe_id,
    )
    return same and (old.reg.node_id == reg.node_id or old.lost_at is not None)


def _static_owner(mesh: m.Mesh, endpoint: m.Endpoint) -> str | None:
    for svc in mesh.services.values():
        for v, ver in svc.versions.items():
            if endpoint in ver.endpoints:
                return f"services.{svc.name}.versions.{v}.endpoints"
    return None


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))

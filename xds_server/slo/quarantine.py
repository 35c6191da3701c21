"""Semantic circuit breaking: outcome windows per (service, request class), the
trip to quarantine, half-open probes with exponential backoff, release.

The control plane's AccessLogService (xds_server/slo/access_log_service.py) feeds `observe` one
outcome per call; this module decides, and the control plane turns its decisions into RDS routes
(`overlay`), pushed and ACK-gated like every other change. State that matters across a restart (the
tripped classes) is kept in a JSON file; the windows are not (they refill from traffic).

Memory is bounded: at most `isolation.max_classes` windows per service, least recently seen
dropped first (most classes are seen once), each window at most BUCKETS small counters, and at
most MAX_QUARANTINED tripped classes per service.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xds_server import mesh as m
from xds_server.store.state_file import write_atomic

log = logging.getLogger(__name__)

BUCKETS = 10  # a window slides in steps of window / BUCKETS
HALF_OPEN_SUCCESSES = 3  # main-pool successes in a row that release a half-open class
MAX_BACKOFF = 64  # the cooldown doubles on each relapse, up to 64 x isolation.cooldown
MAX_QUARANTINED = 256  # per service: RDS routes stay few
FORMAT = 1
PREFIX = "/isolation"


class IsolationError(ValueError):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Window:
    """Calls and failures over the last `BUCKETS` buckets: [epoch, calls, failures] each."""

    __slots__ = ("buckets",)

    def __init__(self) -> None:
        self.buckets: list[list[int]] = []

    def add(self, epoch: int, failed: bool) -> None:
        if self.buckets and self.buckets[-1][0] == epoch:
            b = self.buckets[-1]
            b[1] += 1
            b[2] += failed
        else:
            self.buckets.append([epoch, 1, int(failed)])
            if len(self.buckets) > BUCKETS:
                del self.buckets[0]

    def counts(self, epoch: int) -> tuple[int, int]:
        live = [b for b in self.buckets if b[0] > epoch - BUCKETS]
        return sum(b[1] for b in live), sum(b[2] for b in live)


@dataclass
class Tripped:
    service: str
    key: str
    state: str  # open | half_open | pinned
    since: float  # wall clock
    why: str
    cooldown: float  # seconds before the next half-open
    reopen_at: float  # wall clock; ignored when pinned
    relapses: int = 0
    probe_ok: int = 0
    applied: str = ""  # the config version that carried this state, once every sidecar ACKed

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["since_iso"] = _iso(self.since)
        return d


class Isolation:
    def __init__(
        self,
        mesh: Callable[[], m.Mesh],
        store: str | Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._mesh = mesh
        self._store = Path(store) if store else None
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, OrderedDict[str, Window]] = {}
        self._tripped: dict[tuple[str, str], Tripped] = {}
        self.changed = threading.Event()  # the routes need a push
        self._shared: SharedQuarantine | None = None
        self._load()

    def share(self, shared: SharedQuarantine) -> None:
        """Replicas: quarantine decisions go to the store and come from it, so a
        class tripped by one replica's callers is quarantined at every replica's sidecars.
        The store's quarantines replace this replica's own file's."""
        with self._lock:
            self._tripped = {}
            self._shared = shared
        self.sync()

    # -- outcomes -------------------------------------------------------------------------------
    def observe(
        self, service: str, key: str, failed: bool, *, rerouted: bool = False, reason: str = ""
    ) -> str | None:
        """One call of `key` ended: `failed` by a server fault, `rerouted` when a quarantine
        route took it. Returns "trip", "relapse" or "release" when the class changed state."""
        svc = self._mesh().services.get(service)
        cfg = svc.isolation if svc else None
        if cfg is None or not m.CLASS_KEY.match(key):
            return None
        now = self._clock()
        with self._lock:
            t = self._tripped.get((service, key))
            if t is not None:
                return None if rerouted else self._probe(t, cfg, failed, reason, now)
            if rerouted:  # a call in flight when the class was released
                return None
            wins = self._windows.setdefault(service, OrderedDict())
            win = wins.pop(key, None) or Window()
            wins[key] = win  # most recently seen last
            while len(wins) > cfg.max_classes:
                wins.popitem(last=False)
            epoch = int(now / (cfg.window / BUCKETS))
            win.add(epoch, failed)
            calls, fails = win.counts(epoch)
            if calls < cfg.min_requests or not fails or fails / calls < cfg.error_rate:
                return None
            if sum(1 for s, _ in self._tripped if s == service) >= MAX_QUARANTINED:
                log.warning("isolation: %s has %d classes quarantined; %s left in the pool",
                            service, MAX_QUARANTINED, key)  # fmt: skip
                return None
            del wins[key]
            why = (
                f"{fails} of {calls} calls failed within {cfg.window:g}s "
                f"(error_rate {cfg.error_rate:.4%}, min_requests {cfg.min_requests})"
                + (f", last: {reason}" if reason else "")
            )
            t = Tripped(service, key, "open", now, why, cfg.cooldown, now + cfg.cooldown)
            self._tripped[(service, key)] = t
            self._saved_locked(t)
        log.warning("isolation: class %s of %s quarantined: %s", key, service, why)
        self.changed.set()
        return "trip"

    def _probe(
        self, t: Tripped, cfg: m.Isolation, failed: bool, reason: str, now: float
    ) -> str | None:
        """A call of a tripped class that reached the main pool (half-open probe)."""
        if t.state != "half_open":
            return None  # in flight before the route changed
        if failed:
            t.state, t.relapses, t.probe_ok = "open", t.relapses + 1, 0
            t.cooldown = min(t.cooldown * 2, cfg.cooldown * MAX_BACKOFF)
            t.reopen_at = now + t.cooldown
            t.why = f"relapse {t.relapses} in half-open" + (f": {reason}" if reason else "")
            event = "relapse"
            log.warning("isolation: class %s of %s relapsed, quarantined for %gs",
                        t.key, t.service, t.cooldown)  # fmt: skip
        else:
            t.probe_ok += 1
            if t.probe_ok < HALF_OPEN_SUCCESSES:
                return None
            del self._tripped[(t.service, t.key)]
            event = "release"
            log.warning("isolation: class %s of %s released after %d good probes",
                        t.key, t.service, t.probe_ok)  # fmt: skip
        self._saved_locked(t)
        self.changed.set()
        return event

    def tick(self) -> bool:
        """Cooldowns that ended go half-open; the store's decisions come in (replicas); True
        when that changed a route."""
        now = self._clock()
        with self._lock:
            due = [t for t in self._tripped.values() if t.state == "open" and t.reopen_at <= now]
            for t in due:
                t.state, t.probe_ok = "half_open", 0
                log.info("isolation: class %s of %s half-open", t.key, t.service)
                self._saved_locked(t)
        if due:
            self.changed.set()
        return self.sync() or bool(due)

    def sync(self) -> bool:
        """Replicas: write this replica's decisions to the store, take the others'; True when
        the quarantines changed here. A store that does not answer is tried again next tick."""
        shared = self._shared
        if shared is None:
            return False
        with self._lock:
            dirty = {k: _copy(self._tripped.get(k)) for k in shared.dirty}
            shared.dirty.clear()
        try:
            stored, revs = shared.exchange(dirty)
        except Exception as e:  # StoreError: kept dirty, retried; the routes stay as they are
            with self._lock:
                shared.dirty |= dirty.keys()
            if str(e) != shared.error:  # once per outage, not every tick
                log.warning("isolation: state store: %s; quarantines kept as they are", e)
            shared.error = str(e)
            return False
        shared.error = ""
        with self._lock:
            for k in shared.dirty:  # changed here meanwhile: ours goes out next time
                stored.pop(k, None)
                # ... over the revision our change was made on, not the one just read: a class
                # this replica tripped while another's decision came in must not overwrite it
                revs[k] = shared.revs.get(k, 0)
            shared.revs = revs
            mine = {k: t for k, t in self._tripped.items() if k not in shared.dirty}
            if {k: _decision(t) for k, t in mine.items()} == {
                k: _decision(t) for k, t in stored.items()
            }:
                return False
            for k in mine.keys() - stored.keys():
                del self._tripped[k]
            for k, t in stored.items():
                old = self._tripped.get(k)
                t.applied = old.applied if old is not None and old.state == t.state else ""
                self._tripped[k] = t
        self.changed.set()
        return True

    # -- operator -------------------------------------------------------------------------------
    def release(self, service: str, key: str) -> dict[str, Any]:
        self._check(service, key)
        with self._lock:
            t = self._tripped.pop((service, key), None)
            if t is None:
                raise IsolationError(f"{service}: class {key} is not quarantined", 404)
            self._windows.get(service, OrderedDict()).pop(key, None)
            self._saved_locked(t)
        log.warning("isolation: class %s of %s released by hand", key, service)
        self.changed.set()
        return {"service": service, "key": key, "state": "released"}

    def pin(self, service: str, key: str) -> dict[str, Any]:
        """Quarantine `key` until released by hand (no half-open)."""
        self._check(service, key)
        now = self._clock()
        with self._lock:
            t = self._tripped.get((service, key))
            if t is None:
                t = Tripped(service, key, "pinned", now, "pinned by hand", 0.0, now)
                self._tripped[(service, key)] = t
            elif t.state != "pinned":
                t.state, t.why = "pinned", f"pinned by hand (was: {t.why})"
            self._saved_locked(t)
            out = t.to_json()
        log.warning("isolation: class %s of %s pinned by hand", key, service)
        self.changed.set()
        return out

    def _check(self, service: str, key: str) -> None:
        svc = self._mesh().services.get(service)
        if svc is None:
            raise IsolationError(f"{service}: unknown service", 404)
        if svc.isolation is None:
            raise IsolationError(f"services.{service}.isolation: not configured")
        if not m.CLASS_KEY.match(key):
            raise IsolationError(f"key: expected 16 lowercase hex digits, got {key!r}")

    # -- what the routes say --------------------------------------------------------------------
    def overlay(self, mesh: m.Mesh) -> m.Mesh:
        """`mesh` with each isolated service's quarantined classes (none where isolation is off)."""
        with self._lock:
            tripped = sorted(self._tripped.values(), key=lambda t: (t.service, t.since, t.key))
        for name, svc in mesh.services.items():
            mine = ()
            if svc.isolation is not None:
                mine = tuple(
                    m.Quarantine(
                        t.key, svc.isolation.probe_percent if t.state == "half_open" else 0
                    )
                    for t in tripped
                    if t.service == name
                )
            if mine != svc.quarantined:
                mesh = mesh.with_quarantined(name, mine)
        return mesh

    def mark_applied(self, mesh: m.Mesh, version: str) -> None:
        """Every sidecar ACKed `version`, built from `mesh`: note it on the classes it routes."""
        with self._lock:
            for name, svc in mesh.services.items():
                for q in svc.quarantined:
                    t = self._tripped.get((name, q.key))
                    if t is not None:
                        t.applied = version

    def status(self) -> dict[str, Any]:
        mesh = self._mesh()
        with self._lock:
            out = {}
            for name, svc in mesh.services.items():
                if svc.isolation is None:
                    continue
                out[name] = {
                    "config": dataclasses.asdict(svc.isolation),
                    "classes_tracked": len(self._windows.get(name, ())),
                    "quarantined": [
                        t.to_json() for t in self._tripped.values() if t.service == name
                    ],
                }
            return out

    def tracked(self, service: str) -> int:
        with self._lock:
            return len(self._windows.get(service, ()))

    # -- admin API (mounted under /isolation; the admin server checks the token on POST) -------
    def handle(self, method: str, target: str, body: bytes = b"") -> tuple[int, Any]:
        """GET /isolation; POST /isolation/{service}/{key}/release | pin."""
        parts = [p for p in target.split("?", 1)[0].removeprefix(PREFIX).split("/") if p]
        try:
            if method == "GET" and not parts:
                return 200, self.status()
            if method == "GET" and len(parts) == 1:
                return 200, self.status().get(parts[0]) or self._missing(parts[0])
            if len(parts) == 3 and parts[2] in ("release", "pin"):
                if method != "POST":
                    return 405, {"error": f"{method} not allowed on {target}"}
                return 200, getattr(self, parts[2])(parts[0], parts[1])
        except IsolationError as e:
            return e.status, {"error": str(e)}
        return 404, {"error": f"no such isolation resource: {method} {target}"}

    def _missing(self, service: str) -> dict:
        self._check(service, "0" * 16)
        return {}

    # -- persistence ----------------------------------------------------------------------------
    def _saved_locked(self, changed: Tripped) -> None:
        if self._shared is not None:
            self._shared.dirty.add((changed.service, changed.key))
            return
        if self._store is None:
            return
        doc = {
            "format": FORMAT,
            "quarantined": [dataclasses.asdict(t) for t in self._tripped.values()],
        }
        try:
            write_atomic(self._store, json.dumps(doc, indent=1, sort_keys=True))
        except OSError as e:
            log.error("isolation: cannot save %s: %s", self._store, e)

    def _load(self) -> None:
        if self._store is None:
            return
        try:
            doc = json.loads(self._store.read_text())
        except FileNotFoundError:
            return
        except ValueError as e:
            raise IsolationError(f"{self._store}: not valid JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise IsolationError(f"{self._store}: not an isolation store of format {FORMAT}")
        fields = {f.name for f in dataclasses.fields(Tripped)}
        for i, raw in enumerate(doc.get("quarantined") or []):
            try:
                t = Tripped(**{k: v for k, v in raw.items() if k in fields})
            except TypeError as e:
                raise IsolationError(f"{self._store}: quarantined[{i}]: {e}") from None
            if m.CLASS_KEY.match(str(t.key)):
                t.applied = ""
                self._tripped[(t.service, t.key)] = t
        if self._tripped:
            log.warning("isolation: %d quarantined classes restored from %s",
                        len(self._tripped), self._store)  # fmt: skip


class SharedQuarantine:
    """The quarantined classes of every replica in a store: one key per class
    (`isolation/<service>/<key>`, a Tripped), each written only over the revision this replica
    last read, so two replicas deciding about one class at once never overwrite each other: the
    later one takes the stored decision instead."""

    def __init__(self, store: Any) -> None:  # xds_server.store.Store
        from xds_server.store import keys

        self.store, self._keys = store, keys
        self.dirty: set[tuple[str, str]] = set()  # changed here, not yet written
        self.error = ""  # the store's last error, "" once it answers
        # the store's revision of each class as this replica last took it: what a change here
        # was decided on, and so the only revision it may be written over
        self.revs: dict[tuple[str, str], int] = {}

    def exchange(
        self, changes: dict[tuple[str, str], Tripped | None]
    ) -> tuple[dict[tuple[str, str], Tripped], dict[tuple[str, str], int]]:
        """Write `changes` (None: released), each over the revision taken (a conflict drops
        ours), then read them all: {(service, key): Tripped} and each one's revision."""
        from xds_server.store.base import Check, Conflict, Delete, Put, encode

        for (service, key), t in changes.items():
            k = self._keys.quarantine(service, key)
            op = Delete(k) if t is None else Put(k, encode(_decision(t)))
            try:
                rev = self.store.txn([Check(k, revision=self.revs.get((service, key), 0))], [op])
                self.revs[(service, key)] = 0 if t is None else rev
            except Conflict:
                log.info("isolation: class %s of %s was decided by another replica first",
                         key, service)  # fmt: skip
        entries, _ = self.store.list(self._keys.QUARANTINE)
        fields = {f.name for f in dataclasses.fields(Tripped)}
        out, revs = {}, {}
        for e in entries:
            try:
                t = Tripped(**{k: v for k, v in e.json().items() if k in fields})
                _check_tripped(t, e.key, self._keys.quarantine)
            except (TypeError, ValueError, AttributeError) as err:
                log.error("isolation: %s: not a quarantined class (%s); ignored", e.key,
                          str(err)[:200])  # fmt: skip
                continue
            out[(t.service, t.key)] = t
            revs[(t.service, t.key)] = e.revision
        return out, revs


def _check_tripped(t: Tripped, key: str, key_of: Callable[[str, str], str]) -> None:
    """A decision read from the store, of the types a replica writes, under its own key;
    ValueError if not (anyone who can write the store could have written it)."""
    for f in dataclasses.fields(Tripped):
        kind = {"str": str, "float": (int, float), "int": int}[str(f.type)]
        value = getattr(t, f.name)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"{f.name}: expected {f.type}, got {type(value).__name__}")
    if t.state not in ("open", "half_open", "pinned"):
        raise ValueError(f"state: unknown {t.state!r}")
    if key_of(t.service, t.key) != key:
        raise ValueError(f"class {t.service}/{t.key} under another's key")


def _decision(t: Tripped) -> dict[str, Any]:
    """What replicas share about a class: all but `applied` (each replica's own push)."""
    d = dataclasses.asdict(t)
    del d["applied"]
    return d


def _copy(t: Tripped | None) -> Tripped | None:
    return None if t is None else dataclasses.replace(t)


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def push_loop(
    iso: Isolation,
    push: Callable[[], tuple[m.Mesh, Any] | None],
    stop: threading.Event,
    period: float = 0.25,
) -> None:
    """Until `stop`: move cooldowns on, and push the routes whenever the state changed.
    `push()` stages the live mesh (which the control plane overlays) and waits for ACKs."""
    while not stop.is_set():
        iso.tick()
        if iso.changed.wait(period) and not stop.is_set():
            iso.changed.clear()
            try:
                done = push()
            except Exception:  # a sidecar group that cannot take it: retried on next change
                log.exception("isolation: push failed")
                continue
            if done is not None:
                mesh, result = done
                if result.ok:
                    iso.mark_applied(mesh, result.version)
                else:
                    log.warning("isolation: routes %s not ACKed by %s", result.version,
                                ", ".join(result.missing))  # fmt: skip

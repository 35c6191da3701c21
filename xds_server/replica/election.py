"""Leader election on a store: the singleton work of the control plane (rollouts, the
SLO loop, quarantine decisions) runs on one replica at a time, as istiod's does (a lease of
30 s).

Each candidate holds a lease it keeps alive (every ttl / 3). To lead it creates the leader key
bound to that lease in a transaction that requires the key to be absent; the key's creation
revision is the term, and a Fence of it goes with every leader-only write, so the write fails
once the term is over (xds_server/store/base.py). Followers watch the key and campaign as soon
as it is deleted: when the leader resigns, or its lease expires after it stopped renewing it
(it died, or lost the store).

A leader counts itself deposed when its lease may have ended: `ttl` after the last keep-alive
it sent that the store confirmed. The store's own clock starts later (when it received that
keep-alive), so the old leader stops before a new one can start.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from xds_server.store import keys
from xds_server.store.base import (
    Conflict,
    Fence,
    LeaseLost,
    Store,
    StoreError,
    Watch,
    encode,
)

log = logging.getLogger("meshlm.election")
DEFAULT_TTL = 30.0  # istiod's leader election lease


class NotLeader(StoreError):
    """A leader-only action on a replica that does not lead."""


@dataclass(frozen=True)
class Leader:
    id: str
    term: int  # the leader key's creation revision: a later leader has a larger one
    since: float  # wall clock, when it took office
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "term": self.term,
            "since": self.since,
            "since_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since)),
            "info": self.info,
        }


def current_leader(store: Store, key: str = keys.LEADER) -> Leader | None:
    """Who leads now, as the store says (any replica may ask)."""
    entry = store.get(key)
    return None if entry is None else _leader(entry.value, entry.created)


def _leader(value: bytes, term: int) -> Leader | None:
    try:
        doc = json.loads(value)
        return Leader(str(doc["id"]), term, float(doc["since"]), dict(doc.get("info") or {}))
    except (ValueError, KeyError, TypeError):
        return None  # not one of ours; it still holds the key until its lease ends


class Election:
    """One candidate. `on_change(leading)` runs on the election's thread when this candidate
    takes or loses office; keep it short (start or stop the leader-only work)."""

    def __init__(
        self,
        store: Store,
        candidate: str,
        *,
        key: str = keys.LEADER,
        ttl: float = DEFAULT_TTL,
        info: dict[str, Any] | None = None,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not candidate:
            raise ValueError("election: candidate id must not be empty")
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
            raise ValueError(f"election: ttl must be seconds > 0, got {ttl!r}")
        self.store, self.candidate, self.key, self.ttl = store, candidate, key, float(ttl)
        self.info = dict(info or {})
        self._on_change = on_change
        self._clock = clock
        self._beat = self.ttl / 3
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lease = 0
        self._lease_deadline = 0.0  # monotonic: the lease may have ended from then on
        self._next_beat = 0.0
        self._term = 0  # > 0 while this candidate holds the leader key
        self._announced = False  # what on_change last said
        self._seen: Leader | None = None  # the leader as last read or watched
        self._free = True  # the leader key is absent, as far as this candidate knows
        self._watch: Watch | None = None
        self._error = ""

    # -- what others ask ------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """True while this candidate leads and its lease cannot have ended yet."""
        with self._cond:
            return self._leading_locked()

    def _leading_locked(self) -> bool:
        return self._term > 0 and self._clock() < self._lease_deadline

    def fence(self) -> Fence:
        """The fence for a leader-only write; NotLeader when this candidate does not lead."""
        with self._cond:
            if not self._leading_locked():
                raise NotLeader(f"{self.candidate} does not lead ({self._who()})")
            return Fence(self.key, self._term)

    def leader(self) -> Leader | None:
        """The leader as this candidate last saw it (None: none known)."""
        with self._cond:
            return self._seen

    def status(self) -> dict[str, Any]:
        with self._cond:
            return {
                "candidate": self.candidate,
                "leading": self._leading_locked(),
                "leader": self._seen.to_json() if self._seen else None,
                "ttl": self.ttl,
                "error": self._error,
            }

    def wait(self, leading: bool = True, timeout: float | None = None) -> bool:
        """Block until this candidate leads (or, `leading=False`, does not); False on timeout."""
        end = None if timeout is None else self._clock() + timeout
        with self._cond:
            while self._leading_locked() != leading:
                left = None if end is None else end - self._clock()
                if left is not None and left <= 0:
                    return False
                # Re-check at least each beat: leadership also ends by the clock alone.
                self._cond.wait(self._beat if left is None else min(left, self._beat))
            return True

    def _who(self) -> str:
        s = self._seen
        return f"leader: {s.id}, term {s.term}" if s else "no leader known"

    # -- running --------------------------------------------------------------------------------
    def start(self) -> Election:
        self._thread = threading.Thread(
            target=self._run, name=f"election-{self.candidate}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, resign: bool = True) -> None:
        """Stop campaigning; `resign` revokes the lease, so another candidate takes over at
        once (else only when the lease expires)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.close()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl + 10)
        lease = self._lease
        with self._cond:
            self._term, self._lease = 0, 0
            self._cond.notify_all()
        self._announce()
        if resign and lease:
            try:
                self.store.revoke(lease)
            except StoreError as e:
                log.warning("election %s: resign: %s (the lease expires by itself)", self.key, e)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._round()
                with self._cond:
                    self._error = ""
            except StoreError as e:
                if self._watch is not None:
                    self._watch.close()
                    self._watch = None
                with self._cond:
                    if e.args and str(e) != self._error:
                        log.warning("election %s: %s", self.key, e)
                    self._error = str(e)
                self._stop.wait(min(self._beat, 1.0))
            finally:
                self._announce()

    def _round(self) -> None:
        """Renew the lease when due; campaign when the leader key is free (re-read it when its
        watch was lost); then follow the key's changes until the next beat."""
        try:
            if not self._lease:
                sent = self._clock()
                lease = self.store.grant(self.ttl)
                with self._cond:
                    self._lease, self._lease_deadline = lease, sent + self.ttl
                    self._next_beat = sent + self._beat
            elif self._clock() >= self._next_beat:
                sent = self._clock()
                left = self.store.keepalive(self._lease)
                with self._cond:
                    self._lease_deadline = sent + min(left, self.ttl)
                    self._next_beat = sent + self._beat
            if self._watch is None or (self._term == 0 and self._free):
                self._refresh()
        except LeaseLost:
            with self._cond:
                self._lease, self._term = 0, 0  # the leader key went with the lease
            raise
        if self._term == 0 and self._free:
            return  # it was deleted in between: campaign again at once
        self._announce()  # now, not after the wait below (up to ttl / 3)
        self._await_change()

    def _refresh(self) -> None:
        """Take office if the leader key is free; else read who holds it. Then watch it."""
        if self._term == 0:
            since = time.time()
            value = encode({"id": self.candidate, "since": since, "info": self.info})
            try:
                term = self.store.put(self.key, value, revision=0, lease=self._lease)
            except Conflict:
                pass  # someone leads: follow the key from what it is now
            else:
                with self._cond:
                    self._term, self._free = term, False
                    self._seen = Leader(self.candidate, term, since, self.info)
                log.warning("election %s: %s leads (term %d)", self.key, self.candidate, term)
                self._rewatch(term + 1)
                return
        entry = self.store.get(self.key)
        with self._cond:
            if self._term and (entry is None or entry.created != self._term):
                log.warning("election %s: %s lost the leader key", self.key, self.candidate)
                self._term = 0
            self._free = entry is None
            self._seen = _leader(entry.value, entry.created) if entry else None
        self._rewatch((entry.revision if entry else self.store.revision()) + 1)

    def _rewatch(self, start: int) -> None:
        if self._watch is not None:
            self._watch.close()
        self._watch = self.store.watch(self.key, start)

    def _await_change(self) -> None:
        """Until the next beat, or the leader key is deleted (campaign at once)."""
        while not self._stop.is_set() and self._watch is not None:
            left = self._next_beat - self._clock()
            if left <= 0:
                return
            ev = self._watch.get(timeout=left)
            if ev is None or ev.key != self.key:
                continue
            with self._cond:
                if ev.kind == "put" and ev.created == self._term:
                    continue  # our own key
                lost = self._term > 0
                self._term = 0
                self._free = ev.kind == "delete"
                self._seen = _leader(ev.value, ev.created) if ev.kind == "put" else None
            if lost:
                log.warning("election %s: %s lost the leader key (%s)", self.key,
                            self.candidate, ev.kind)  # fmt: skip
            if ev.kind == "delete":
                return

    def _announce(self) -> None:
        """Tell on_change when leading changed (by the clock too: the lease may have ended)."""
        with self._cond:
            leading = self._leading_locked() and not self._stop.is_set()
            if leading == self._announced:
                return
            self._announced = leading
            self._cond.notify_all()
        if not leading:
            log.warning("election %s: %s steps down", self.key, self.candidate)
        if self._on_change is not None:
            try:
                self._on_change(leading)
            except Exception:
                log.exception("election %s: on_change(%s) failed", self.key, leading)

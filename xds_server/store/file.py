"""The embedded store: one JSON file beside the mesh file, for a single control plane.

Same contract as etcd (xds_server/store/base.py), kept in memory and written through: every
transaction replaces the file atomically (xds_server/rollout_store.write_atomic) before it is
visible, so a crash loses nothing that was acknowledged. Leases live in memory only: a restart
has no leaseholders, so keys bound to leases are not written. The watch history is in memory
too (the last HISTORY events): a watch from before a restart is Compacted.

One process owns the file (an exclusive flock on FILE.lock); a second one is refused, since
two writers of one file would each overwrite the other's state. Replicas use etcd.
"""

from __future__ import annotations

import base64
import fcntl
import itertools
import json
import math
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from xds_server.store.base import (
    Check,
    Compacted,
    Delete,
    Entry,
    Event,
    LeaseLost,
    Op,
    Put,
    Store,
    StoreError,
    Watch,
    conflict,
)
from xds_server.store.state_file import write_atomic

FORMAT = 1
HISTORY = 10_000  # events a watch can replay


class FileStore(Store):
    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.monotonic,
        history: int = HISTORY,
    ) -> None:
        self.path = Path(path)
        self._clock = clock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_file = self._own(self.path.with_name(self.path.name + ".lock"))
        self._cond = threading.Condition()
        self._kv: dict[str, Entry] = {}
        self._rev = 0
        try:
            self._load()
        except BaseException:
            self._lock_file.close()
            raise
        self._history: deque[tuple[int, Event]] = deque(maxlen=history)
        self._seq = 0  # events ever logged (a txn's events share a revision)
        self._first = self._rev + 1  # the oldest revision a watch may start from
        self._leases: dict[int, tuple[float, float]] = {}  # id -> (ttl, deadline)

    def _own(self, lock_path: Path) -> TextIO:
        f = open(lock_path, "a")  # noqa: SIM115 (held open while the store lives)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise StoreError(
                f"{self.path}: in use by another control plane (it holds {lock_path}); "
                "several replicas need a shared store: --store etcd://HOST:PORT,..."
            ) from None
        return f

    def close(self) -> None:
        with self._cond:
            if not self._lock_file.closed:
                self._lock_file.close()  # releases the flock

    # -- reads ----------------------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        with self._cond:
            self._expire()
            return self._kv.get(key)

    def list(self, prefix: str) -> tuple[list[Entry], int]:
        with self._cond:
            self._expire()
            return [self._kv[k] for k in sorted(self._kv) if k.startswith(prefix)], self._rev

    def revision(self) -> int:
        with self._cond:
            self._expire()
            return self._rev

    # -- writes ---------------------------------------------------------------------------------
    def txn(self, checks: Sequence[Check], ops: Sequence[Op]) -> int:
        with self._cond:
            self._expire()
            for c in checks:
                e = self._kv.get(c.key)
                if c.revision is not None and (e.revision if e else 0) != c.revision:
                    raise conflict(c, e)
                if c.created is not None and (e.created if e else 0) != c.created:
                    raise conflict(c, e)
            for op in ops:
                if isinstance(op, Put) and op.lease and op.lease not in self._leases:
                    raise LeaseLost(f"lease {op.lease:x}: not found (expired or revoked)")
            return self._commit(ops)

    def _commit(self, ops: Sequence[Op]) -> int:
        """Apply `ops` at the next revision: written to the file, then visible. Lock held."""
        rev = self._rev + 1
        kv = dict(self._kv)
        events = []
        for op in ops:
            if isinstance(op, Put):
                old = kv.get(op.key)
                kv[op.key] = Entry(op.key, op.value, rev, old.created if old else rev, op.lease)
                events.append(Event("put", op.key, op.value, rev, kv[op.key].created))
            elif kv.pop(op.key, None) is not None:
                events.append(Event("delete", op.key, b"", rev))
        if not events:
            return self._rev
        self._save(kv, rev)  # raises before anything is visible
        self._kv, self._rev = kv, rev
        for ev in events:
            if len(self._history) == self._history.maxlen:  # the oldest event drops out
                self._first = self._history[0][1].revision + 1
            self._seq += 1
            self._history.append((self._seq, ev))
        self._cond.notify_all()
        return rev

    # -- leases ---------------------------------------------------------------------------------
    def grant(self, ttl: float) -> int:
        ttl = _ttl(ttl)
        with self._cond:
            self._expire()
            lease = secrets.randbits(62) + 1
            self._leases[lease] = (ttl, self._clock() + ttl)
            return lease

    def keepalive(self, lease: int) -> float:
        with self._cond:
            self._expire()
            if lease not in self._leases:
                raise LeaseLost(f"lease {lease:x}: not found (expired or revoked)")
            ttl, _ = self._leases[lease]
            self._leases[lease] = (ttl, self._clock() + ttl)
            return ttl

    def revoke(self, lease: int) -> None:
        with self._cond:
            if self._leases.pop(lease, None) is not None:
                self._commit([Delete(k) for k, e in sorted(self._kv.items()) if e.lease == lease])

    def _expire(self) -> None:
        """End the leases past their deadline and delete their keys. Lock held."""
        now = self._clock()
        for lease in [i for i, (_, deadline) in self._leases.items() if deadline <= now]:
            self.revoke(lease)

    def _next_expiry(self) -> float:
        return min((d for _, d in self._leases.values()), default=math.inf)

    # -- watches --------------------------------------------------------------------------------
    def watch(self, prefix: str, start_revision: int) -> Watch:
        with self._cond:
            if start_revision < self._first:
                raise Compacted(
                    f"watch from revision {start_revision}: history starts at {self._first}"
                )
            return _FileWatch(self, prefix, start_revision)

    # -- the file -------------------------------------------------------------------------------
    def _load(self) -> None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ValueError(f"not a state store of format {FORMAT}")
            self._rev = _count(doc.get("revision"), "revision")
            for key, raw in (doc.get("keys") or {}).items():
                if not isinstance(raw, dict):
                    raise ValueError(f"keys.{key}: expected a mapping")
                if "value_b64" in raw:
                    value = base64.b64decode(raw["value_b64"], validate=True)
                else:
                    value = str(raw["value"]).encode()
                rev = _count(raw.get("revision"), f"keys.{key}.revision")
                created = _count(raw.get("created"), f"keys.{key}.created")
                self._kv[key] = Entry(key, value, rev, created)
        except (ValueError, KeyError, TypeError) as e:  # left untouched for an operator
            raise StoreError(f"{self.path}: {e}") from None

    def _save(self, kv: dict[str, Entry], rev: int) -> None:
        keys = {}
        for k, e in sorted(kv.items()):
            if e.lease:  # ends with this process
                continue
            try:  # readable in the file when it is text (the state is JSON)
                raw = {"value": e.value.decode()}
            except UnicodeDecodeError:
                raw = {"value_b64": base64.b64encode(e.value).decode()}
            keys[k] = {**raw, "revision": e.revision, "created": e.created}
        doc = {"format": FORMAT, "revision": rev, "keys": keys}
        try:
            write_atomic(self.path, json.dumps(doc, indent=1, sort_keys=True))
        except OSError as e:
            raise StoreError(f"{self.path}: cannot write: {e}") from e


class _FileWatch(Watch):
    def __init__(self, store: FileStore, prefix: str, start: int) -> None:
        """Lock held: `start` is at or after the oldest revision kept."""
        self._store, self._prefix = store, prefix
        # The sequence number of the last event passed over: all before `start`.
        self._seq = store._seq - sum(1 for _, ev in store._history if ev.revision >= start)
        self._closed = False

    def get(self, timeout: float | None = None) -> Event | None:
        s = self._store
        deadline = None if timeout is None else s._clock() + timeout
        with s._cond:
            while not self._closed:
                s._expire()
                ev = self._next()
                if ev is not None:
                    return ev
                now = s._clock()
                if deadline is not None and now >= deadline:
                    return None
                wait = min(math.inf if deadline is None else deadline - now, s._next_expiry() - now)
                s._cond.wait(None if wait == math.inf else max(wait, 0.001))
            raise StoreError("watch closed")

    def _next(self) -> Event | None:
        history = self._store._history
        if not history:
            return None
        i = self._seq + 1 - history[0][0]
        if i < 0:
            behind = f"fell more than {len(history)} events behind"
            raise Compacted(f"watch of {self._prefix!r} {behind}")
        for seq, ev in itertools.islice(history, i, None):
            self._seq = seq
            if ev.key.startswith(self._prefix):
                return ev
        return None

    def close(self) -> None:
        with self._store._cond:
            self._closed = True
            self._store._cond.notify_all()


def _ttl(ttl: float) -> float:
    if isinstance(ttl, bool) or not (isinstance(ttl, int | float) and 0 < ttl < math.inf):
        raise ValueError(f"lease ttl: expected seconds > 0, got {ttl!r}")
    return float(ttl)


def _count(v: object, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{path}: expected a revision (integer >= 0), got {v!r}")
    return v

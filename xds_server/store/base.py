"""The control plane's state store: a seam with two implementations, the local file (one
control plane, the default) and etcd (replicas).

The model is etcd's, so both behave alike: a flat key space of bytes; one store-wide revision
that every write transaction bumps; each key remembers the revision that created it and the one
that last wrote it; writes are transactions that first compare revisions, so a writer that read
a stale value is refused instead of overwriting (never last-writer-wins); leases whose expiry
deletes the keys bound to them; watches that replay every change from a revision, in order.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class StoreError(RuntimeError):
    """The store refused or could not do what was asked."""


class StoreUnavailable(StoreError):
    """No answer within the deadline (store down, no quorum, partitioned). Nothing is known
    about a write that raised this: read before writing again (the revision check makes a
    retried write safe)."""


class Conflict(StoreError):
    """A transaction's check failed: the key changed since the writer read it."""

    def __init__(self, message: str, key: str, expected: int, actual: int) -> None:
        super().__init__(message)
        self.key, self.expected, self.actual = key, expected, actual


class Fenced(Conflict):
    """A leader-only write from a term that has ended (another candidate leads, or none)."""


class Compacted(StoreError):
    """A watch asked for history the store no longer keeps: list again, watch from there."""


class LeaseLost(StoreError):
    """The lease expired or was revoked; the keys bound to it are gone."""


@dataclass(frozen=True)
class Entry:
    key: str
    value: bytes
    revision: int  # the store revision that last wrote it (etcd's mod_revision)
    created: int  # the store revision that created it (etcd's create_revision)
    lease: int = 0

    def json(self) -> Any:
        """The value as JSON, parsed within bounds (decode); ValueError names the key."""
        return decode(self.value, self.key)


@dataclass(frozen=True)
class Event:
    kind: str  # "put" | "delete"
    key: str
    value: bytes  # empty for a delete
    revision: int
    created: int = 0  # 0 for a delete


@dataclass(frozen=True)
class Check:
    """One comparison of a transaction: `revision` (0: the key is absent) or `created`."""

    key: str
    revision: int | None = None
    created: int | None = None

    def __post_init__(self) -> None:
        if (self.revision is None) == (self.created is None):
            raise ValueError("Check: give exactly one of revision, created")


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    lease: int = 0  # the key is deleted when this lease ends


@dataclass(frozen=True)
class Delete:
    key: str


Op = Put | Delete


@dataclass(frozen=True)
class Fence:
    """The proof of a leadership term: the leader key still exists with this creation
    revision. A leader-only write carries it, so a deposed leader's write fails."""

    key: str
    term: int

    def check(self) -> Check:
        return Check(self.key, created=self.term)


MAX_DOC = 4 << 20  # bytes, as the admin API's largest body: a mesh file with thousands of tenants
MAX_DEPTH = 64  # levels of nesting; a mesh document has about ten


def decode(value: bytes, key: str) -> Any:
    """A store value as JSON, at most MAX_DOC bytes and MAX_DEPTH levels deep (anyone who can
    write the store can write any value: no parser may recurse on it unbounded); ValueError
    naming `key` otherwise."""
    if len(value) > MAX_DOC:
        raise ValueError(f"{key}: {len(value)} bytes, over the limit of {MAX_DOC}")
    if _depth_over(value, MAX_DEPTH):
        raise ValueError(f"{key}: nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(value)
    except RecursionError:  # (not reached: the depth is checked first)
        raise ValueError(f"{key}: nested too deeply") from None
    except ValueError as e:
        raise ValueError(f"{key}: not JSON ({e})") from None


def _depth_over(raw: bytes, limit: int) -> bool:
    """Whether the JSON text `raw` opens more than `limit` brackets at once (strings skipped),
    counted before anything parses it."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth, in_string, escaped = 0, False, False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


def encode(doc: Any) -> bytes:
    """A JSON document as a store value (sorted keys: equal documents, equal bytes)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


class Watch(ABC):
    """Changes under a prefix, one event at a time in revision order."""

    @abstractmethod
    def get(self, timeout: float | None = None) -> Event | None:
        """The next event; None when `timeout` passed first. Raises StoreError (Compacted,
        StoreUnavailable) once the watch has ended; watch again from the last revision + 1."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Store(ABC):
    @abstractmethod
    def txn(self, checks: Sequence[Check], ops: Sequence[Op]) -> int:
        """Apply `ops` atomically if every check holds; the store revision after it. Raises
        Conflict (Fenced for a `created` check) naming the first check that failed."""

    @abstractmethod
    def get(self, key: str) -> Entry | None: ...

    @abstractmethod
    def list(self, prefix: str) -> tuple[list[Entry], int]:
        """The keys under `prefix` in key order, and the store revision they were read at
        (watch from that + 1 to miss nothing)."""

    @abstractmethod
    def watch(self, prefix: str, start_revision: int) -> Watch:
        """Every change under `prefix` from `start_revision` on (history included)."""

    @abstractmethod
    def revision(self) -> int: ...

    @abstractmethod
    def grant(self, ttl: float) -> int:
        """A new lease that ends `ttl` seconds after its last keep-alive; its id."""

    @abstractmethod
    def keepalive(self, lease: int) -> float:
        """Renew `lease`; the seconds it now has left. Raises LeaseLost when it has ended."""

    @abstractmethod
    def revoke(self, lease: int) -> None:
        """End `lease` now (its keys are deleted); no error when it already ended."""

    def close(self) -> None:  # noqa: B027 (a store without resources needs nothing)
        pass

    # -- the writes the control plane makes, as transactions ------------------------------------
    def put(
        self,
        key: str,
        value: bytes,
        *,
        revision: int,
        fence: Fence | None = None,
        lease: int = 0,
    ) -> int:
        """Write `key` if it was last written at `revision` (0: only if absent)."""
        return self.txn(_checks(key, revision, fence), [Put(key, value, lease)])

    def delete(self, key: str, *, revision: int, fence: Fence | None = None) -> int:
        """Delete `key` if it was last written at `revision`."""
        return self.txn(_checks(key, revision, fence), [Delete(key)])

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checks(key: str, revision: int, fence: Fence | None) -> list[Check]:
    # The fence first: a deposed leader hears that it is deposed, not that the key moved.
    checks = [fence.check()] if fence is not None else []
    return [*checks, Check(key, revision=revision)]


def conflict(check: Check, actual: Entry | None) -> Conflict:
    """The error for a failed check, `actual` being the key as it is now."""
    if check.created is not None:
        now = actual.created if actual else 0
        return Fenced(
            f"fenced: {check.key} was created at revision {check.created} (this term), "
            + (f"now at {now}: another term began" if now else "now absent: the term ended"),
            check.key,
            check.created,
            now,
        )
    now = actual.revision if actual else 0
    expected = check.revision or 0
    if expected == 0:
        msg = f"{check.key}: exists (written at revision {now}); expected it absent"
    elif now == 0:
        msg = f"{check.key}: deleted; expected it as written at revision {expected}"
    else:
        msg = f"{check.key}: written at revision {now}, expected {expected}: read it again"
    return Conflict(msg, check.key, expected, now)

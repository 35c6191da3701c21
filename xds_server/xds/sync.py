"""Sync status per sidecar and type: what was sent, what was ACKed, the last NACK, time to ACK;
which sidecars lag; and a convergence histogram (change staged -> every affected sidecar ACKed).

The node table is bounded (`Limits`): a node id is admitted once at a time, metadata has a size
limit, departed sidecars are forgotten after `forget_after`, and only known xDS types are kept.
"""

from __future__ import annotations

import bisect
import collections
import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from mesh_common import type_urls as t
from xds_server.xds.node import NodeInfo

# One line per connect, disconnect, push, ACK and NACK, with its fields as `extra`
# for --log-format json; logged after the lock is released.
log = logging.getLogger(__name__)


def _event(level: int, event: str, node_id: str, text: str, **fields: Any) -> None:
    if log.isEnabledFor(level):
        log.log(
            level,
            "%s %s: %s",
            event,
            node_id,
            text,
            extra={"event": event, "node": node_id, **fields},
        )


@dataclass(frozen=True)
class Limits:
    max_nodes: int = 20_000  # sidecars tracked, connected or recently departed: a 10,000 fleet
    # and room for the ids it leaves behind while it reconnects
    max_node_id_bytes: int = 256
    max_metadata_bytes: int = 4096  # node.metadata, serialized (ours is under 1 KiB)
    max_resource_names: int = 10_000  # names one stream may subscribe to per type
    max_resource_name_bytes: int = 1024  # of each of those names
    max_error_chars: int = 1024  # of a NACK's error_detail kept in status
    forget_after: float = 600.0  # seconds a departed sidecar stays in status
    lagging_after: float = 30.0  # seconds un-ACKed before a sidecar no longer holds changes back
    # New streams served a second (as many at once after a quiet second): in a connection storm
    # the rest wait their turn, open, and the streams already served keep their pushes.
    admit_per_s: float = 2_000.0


class NodeRejected(Exception):
    """A stream that is not admitted; `code` names the gRPC status code to close it with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)  # one per type per sidecar: thousands
class TypeSync:
    sent_version: str = ""
    sent_at: float = 0.0
    pushes: int = 0  # responses sent for this type on this node's streams
    acked_version: str = ""
    acked_at: float = 0.0
    ack_seconds: float | None = None  # time from the last send to its ACK
    nack_version: str = ""  # cleared once a later version is ACKed (see `recovered`)
    nack_error: str = ""
    nack_at: float = 0.0
    recovered: str = ""  # the last NACK a later ACK cleared, and when
    stale_nonces: int = 0
    pending_since: float = 0.0  # oldest push not yet ACKed or NACKed; 0: none


@dataclass(slots=True)
class NodeSync:
    node_id: str
    group: NodeInfo
    api: str  # "sotw" | "delta"
    connected: bool = True
    connected_at: float = field(default_factory=time.time)
    disconnected_at: float = 0.0
    stream: int = 0
    error: str = ""  # why no snapshot could be built for this node
    types: dict[str, TypeSync] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)  # as announced; never mutated
    spiffe_id: str = ""  # from its client certificate (ADS over mTLS)


# Histogram bucket upper bounds, seconds.
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, float("inf"))


# Convergence timers kept at once; older ones (superseded changes) are dropped untimed.
MAX_TRACKERS = 16


@dataclass
class _Tracker:
    generation: int
    started: float
    remaining: set[str]


@dataclass
class _Waiter:
    generation: int
    remaining: set[str]
    acked: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)
    lagging: set[str] = field(default_factory=set)
    recheck_at: float = float("inf")  # when the next pending node would count as lagging
    done: threading.Event = field(default_factory=threading.Event)


class SyncStatus:
    """Thread-safe; written by the ADS streams, read by the API and /debug/syncz.

    `retain_groups` is called (under this lock) with the groups of every node still tracked
    whenever departed nodes are forgotten, so their snapshots can go too; `membership_changed`
    (under this lock too) whenever a sidecar connects or disconnects."""

    def __init__(
        self,
        expected: Callable[[NodeInfo, int], dict[str, int]],
        generation_of: Callable[[str], int],
        limits: Limits | None = None,
        retain_groups: Callable[[set[NodeInfo]], None] | None = None,
        membership_changed: Callable[[], None] | None = None,
    ) -> None:
        self._expected = expected
        self._generation_of = generation_of
        self.limits = limits or Limits()
        self._retain_groups = retain_groups
        self._membership_changed = membership_changed or (lambda: None)
        self.cond = threading.Condition()
        self.nodes: dict[str, NodeSync] = {}
        # group -> ids of its connected sidecars: staging a change asks for these, and a scan
        # of every node per change cost more than the change itself at fleet scale.
        self.connected: dict[NodeInfo, set[str]] = {}
        self.rejected: collections.deque[dict[str, Any]] = collections.deque(maxlen=20)
        self._streams = 0
        self._latest = 0  # newest tracked generation
        self._next_sweep = 0.0
        self._trackers: dict[int, _Tracker] = {}
        self._next_full_check = 0.0
        self._waiters: list[_Waiter] = []
        # Bumped by every connect, ACK, NACK and departure: replicas summarise their sidecars
        # for the others only when it moved (xds_server/replica/replication.py).
        self.changes = 0
        self.histogram = [0] * len(BUCKETS)
        self.convergence: list[float] = []  # seconds, newest last (bounded)
        self.convergence_sum = 0.0  # seconds, every change since start (Prometheus' _sum)
        # Since start, by type URL: responses sent and NACKs received (never decrease, unlike
        # the per-node counts, which go with a departed sidecar).
        self.pushes: collections.Counter[str] = collections.Counter()
        self.rejects: collections.Counter[str] = collections.Counter()

    # -- admission ------------------------------------------------------------------------------
    def check_node(self, node_id: str, metadata_bytes: int) -> None:
        """Raise NodeRejected (INVALID_ARGUMENT, naming the field and the limit) for a node
        announcement that is not admitted; called before its metadata is parsed."""
        lim = self.limits
        if not node_id:
            self.reject("", "INVALID_ARGUMENT", "node.id is empty: every sidecar needs one")
        if len(node_id.encode()) > lim.max_node_id_bytes:
            self.reject(
                node_id,
                "INVALID_ARGUMENT",
                f"node.id is {len(node_id.encode())} bytes, over the limit of "
                f"{lim.max_node_id_bytes} (max_node_id_bytes)",
            )
        if not node_id.isprintable():
            self.reject(
                node_id,
                "INVALID_ARGUMENT",
                f"node.id {node_id[:64]!r} has a character that is not printable: ids are "
                "printable text",
            )
        if metadata_bytes > lim.max_metadata_bytes:
            self.reject(
                node_id,
                "INVALID_ARGUMENT",
                f"node.metadata is {metadata_bytes} bytes, over the limit of "
                f"{lim.max_metadata_bytes} (max_metadata_bytes)",
            )

    def reject(self, node_id: str, code: str, message: str) -> None:
        """Raise NodeRejected, remembered among the last rejections (/debug/syncz)."""
        with self.cond:
            self.rejected.append(
                {"node_id": node_id[:64], "code": code, "reason": message, "at": time.time()}
            )
        raise NodeRejected(code, message)

    # -- written by streams -------------------------------------------------------------------
    def connect(
        self,
        node_id: str,
        group: NodeInfo,
        api: str,
        metadata: dict[str, Any] | None = None,
        spiffe_id: str = "",
    ) -> int:
        """Register a stream for `node_id`; returns its stream number. Raises NodeRejected when
        the id is held by a live stream (ALREADY_EXISTS) or the table is full."""
        with self.cond:
            now = time.time()
            self._sweep(now)
            old = self.nodes.get(node_id)
            if old is not None and old.connected:
                # Envoy retries with backoff, so a sidecar reconnecting before its old stream
                # was seen to end gets in on a later try.
                self.reject(
                    node_id,
                    "ALREADY_EXISTS",
                    f"node id {node_id!r} is already connected on another stream; "
                    "each sidecar needs a unique node id",
                )
            if old is None and len(self.nodes) >= self.limits.max_nodes:
                self._evict_departed(len(self.nodes) - self.limits.max_nodes + 1)
                if len(self.nodes) >= self.limits.max_nodes:
                    self.reject(
                        node_id,
                        "RESOURCE_EXHAUSTED",
                        f"the control plane tracks at most {self.limits.max_nodes} sidecars "
                        "(max_nodes), all connected",
                    )
            self._streams += 1
            ns = NodeSync(node_id=node_id, group=group, api=api, stream=self._streams)
            ns.metadata, ns.spiffe_id = metadata or {}, spiffe_id
            if old is not None:
                # A reconnect keeps the history of what this sidecar ACKed and rejected; what
                # was outstanding on the old stream is not any more.
                ns.types = old.types
                for ts in ns.types.values():
                    ts.pending_since = 0.0
            self.nodes[node_id] = ns
            self.connected.setdefault(group, set()).add(node_id)
            self.changes += 1
            self._membership_changed()
            self.cond.notify_all()
        who = f" as {spiffe_id}" if spiffe_id else ""
        _event(logging.INFO, "connect", node_id, f"{api} stream {ns.stream}, {group.label()}{who}",
               api=api, stream=ns.stream, spiffe_id=spiffe_id)  # fmt: skip
        return ns.stream

    def disconnect(self, node_id: str, stream: int) -> None:
        with self.cond:
            ns = self.nodes.get(node_id)
            mine = ns is not None and ns.stream == stream
            if mine:
                ns.connected = False
                ns.disconnected_at = time.time()
                ids = self.connected[ns.group]
                ids.discard(node_id)
                if not ids:
                    del self.connected[ns.group]
                self._progress(node_id, ns.disconnected_at)
                self._membership_changed()
            self.cond.notify_all()
        if mine:
            _event(logging.INFO, "disconnect", node_id, f"stream {stream} ended", stream=stream)

    def set_error(self, node_id: str, error: str) -> None:
        with self.cond:
            if node_id in self.nodes:
                self.nodes[node_id].error = error
                self._progress(node_id, time.time())
            self.cond.notify_all()

    def sent(self, node_id: str, type_url: str, version: str) -> None:
        with self.cond:
            ts = self._type(node_id, type_url)
            if ts is None:
                return
            ts.sent_version, ts.sent_at = version, time.time()
            ts.pending_since = ts.pending_since or ts.sent_at
            ts.pushes += 1
            self.pushes[type_url] += 1
        if log.isEnabledFor(logging.INFO):  # once per sidecar per push: no text built for nothing
            _event(logging.INFO, "push", node_id, f"{t.SHORT[type_url]} {version}",
                   type=t.SHORT[type_url], version=version)  # fmt: skip

    def stale(self, node_id: str, type_url: str) -> None:
        with self.cond:
            ts = self._type(node_id, type_url)
            if ts is not None:
                ts.stale_nonces += 1

    def ack(self, node_id: str, type_url: str, version: str) -> None:
        with self.cond:
            ts = self._type(node_id, type_url)
            if ts is None:
                return
            now = time.time()
            ts.acked_version, ts.acked_at = version, now
            if ts.sent_version == version and ts.sent_at:
                ts.ack_seconds = now - ts.sent_at
            # An older ACK (delta) is progress: the clock restarts at the newest push.
            ts.pending_since = 0.0 if version == ts.sent_version else ts.sent_at
            if ts.nack_version and (
                version == ts.sent_version
                or self._generation_of(version) > self._generation_of(ts.nack_version)
            ):
                ts.recovered = (
                    f"NACK of {ts.nack_version} at {_iso(ts.nack_at)} ({ts.nack_error}) "
                    f"cleared by ACK of {version} at {_iso(now)}"
                )
                ts.nack_version, ts.nack_error, ts.nack_at = "", "", 0.0
            self._progress(node_id, now)
            self.cond.notify_all()
        if log.isEnabledFor(logging.INFO):
            _event(logging.INFO, "ack", node_id, f"{t.SHORT[type_url]} {version}",
                   type=t.SHORT[type_url], version=version)  # fmt: skip

    def nack(self, node_id: str, type_url: str, version: str, error: str) -> None:
        with self.cond:
            ts = self._type(node_id, type_url)
            if ts is None:
                return
            error = error[: self.limits.max_error_chars]
            ts.nack_version, ts.nack_error, ts.nack_at = version, error, time.time()
            self.rejects[type_url] += 1
            if version == ts.sent_version:
                ts.pending_since = 0.0
            self._progress(node_id, ts.nack_at)
            self.cond.notify_all()
        _event(logging.WARNING, "nack", node_id, f"{t.SHORT[type_url]} {version}: {error}",
               type=t.SHORT[type_url], version=version, error=error)  # fmt: skip

    # -- convergence ----------------------------------------------------------------------------
    def track(self, generation: int, nodes: list[str]) -> None:
        """Start timing a change: it converges when every one of `nodes` holds it."""
        with self.cond:
            now = time.time()
            self._latest = max(self._latest, generation)
            self._sweep(now)
            self._trackers[generation] = _Tracker(generation, now, set(nodes))
            for gen, tr in list(self._trackers.items()):
                # A sidecar that went away, or a change long superseded (endpoint churn stages
                # many before one push): stop timing it.
                if now - tr.started > 120 or len(self._trackers) > MAX_TRACKERS:
                    del self._trackers[gen]
            # A new tracker needs no check: its sidecars cannot hold a generation that is not
            # published yet (ACKs settle them), so staging a change costs no per-sidecar work;
            # one that no sidecar needs converged at once. Sidecars that stopped ACKing are
            # looked for at most once a second, and only in trackers old enough for one to lag.
            if not nodes:
                self._progress(None, now, only=generation)
            if now >= self._next_full_check:
                self._next_full_check = now + 1.0
                for gen, tr in list(self._trackers.items()):
                    if now - tr.started >= self.limits.lagging_after:
                        self._progress(None, now, only=gen)

    def state(self, node_id: str, generation: int) -> tuple[str, str]:
        """("acked" | "nacked" | "pending" | "lagging" | "disconnected", error) for one node."""
        with self.cond:
            state, error, since = self._state(node_id, generation)
            if state == "pending" and self._lags(since, time.time()):
                state = "lagging"
            return state, error

    def _state(self, node_id: str, generation: int) -> tuple[str, str, float]:
        """(state, error, since): for "pending", since when the node has been behind."""
        ns = self.nodes.get(node_id)
        if ns is None or not ns.connected:
            return "disconnected", "", 0.0
        if ns.error:
            return "nacked", ns.error, 0.0
        expected = self._expected(ns.group, generation)
        pending = False
        since = float("inf")
        for tu, gen in expected.items():
            ts = ns.types.get(tu)
            if ts is None:  # never asked for it
                pending, since = True, min(since, ns.connected_at)
                continue
            if self._generation_of(ts.acked_version) >= gen:
                continue
            if ts.nack_error and self._generation_of(ts.nack_version) >= gen:
                return "nacked", f"{t.SHORT.get(tu, tu)} {ts.nack_version}: {ts.nack_error}", 0.0
            pending = True
            if ts.pending_since:  # 0: the version was not pushed yet
                since = min(since, ts.pending_since)
        return ("pending" if pending else "acked"), "", since

    def _lags(self, since: float, now: float) -> bool:
        return now - since >= self.limits.lagging_after

    def wait(
        self, generation: int, nodes: list[str], timeout: float
    ) -> tuple[list[str], dict[str, str], list[str], list[str]]:
        """Block until each node holds `generation` (ACKed it or later), rejected it, went
        away, or lags (un-ACKed for `lagging_after`), or `timeout` passed. Returns (acked,
        errors by node, missing, lagging). Each ACK re-checks only its own node, so waiting on
        thousands of sidecars stays linear; every node is re-checked only when one may have
        started to lag."""
        w = _Waiter(generation, set(nodes))
        deadline = time.monotonic() + timeout
        with self.cond:
            self._settle_all(w)
            if w.remaining:
                self._waiters.append(w)
        while w.remaining:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if w.done.wait(min(left, max(0.0, w.recheck_at - time.time()) + 0.01)):
                break
            with self.cond:
                self._settle_all(w)
        with self.cond:
            if w in self._waiters:
                self._waiters.remove(w)
            missing = sorted(set(nodes) - w.acked - w.lagging)
            return sorted(w.acked), dict(w.errors), missing, sorted(w.lagging)

    def _settle_all(self, w: _Waiter) -> None:
        w.recheck_at = float("inf")
        for n in list(w.remaining):
            self._settle(w, n)
        if not w.remaining:
            w.done.set()

    def _settle(self, w: _Waiter, node_id: str) -> None:
        state, error, since = self._state(node_id, w.generation)
        if state == "acked":
            w.acked.add(node_id)
        elif state == "nacked":
            w.errors[node_id] = error
        elif state == "pending":
            if not self._lags(since, time.time()):
                w.recheck_at = min(w.recheck_at, since + self.limits.lagging_after)
                return
            w.lagging.add(node_id)  # out of the quorum: one stuck sidecar holds nothing back
        w.remaining.discard(node_id)

    def _progress(self, node_id: str | None, now: float, only: int | None = None) -> None:
        """Settle waiters and convergence trackers on `node_id`'s news (None: every node, of
        every tracker or of tracker `only`)."""
        self.changes += 1
        if node_id is not None:
            for w in list(self._waiters):
                if node_id in w.remaining:
                    self._settle(w, node_id)
                    if not w.remaining:
                        self._waiters.remove(w)
                        w.done.set()
        if node_id is not None:  # one node's news touches only the trackers that wait on it
            trackers = [tr for tr in self._trackers.values() if node_id in tr.remaining]
        else:
            trackers = [tr for g, tr in self._trackers.items() if only is None or g == only]
        if len(trackers) > 1:
            trackers.sort(key=lambda tr: tr.generation, reverse=True)
        held = -1  # the newest tracked generation `node_id` holds: it holds every older one
        for tr in trackers:
            for n in [node_id] if node_id is not None else list(tr.remaining):
                if tr.generation <= held:
                    tr.remaining.discard(n)
                    continue
                state, _, since = self._state(n, tr.generation)
                if state == "acked" and node_id is not None:
                    held = tr.generation
                if state in ("acked", "disconnected") or (
                    state == "pending" and self._lags(since, now)
                ):
                    tr.remaining.discard(n)
            if not tr.remaining:
                self._record(now - tr.started)
                del self._trackers[tr.generation]

    def _record(self, seconds: float) -> None:
        self.histogram[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.convergence_sum += seconds
        self.convergence.append(seconds)
        del self.convergence[:-1000]

    def _type(self, node_id: str, type_url: str) -> TypeSync | None:
        if type_url not in t.SHORT:  # only known types are kept
            return None
        types = self.nodes[node_id].types
        ts = types.get(type_url)
        if ts is None:
            ts = types[type_url] = TypeSync()
        return ts

    # -- forgetting departed sidecars ---------------------------------------------------------
    def live_groups(self) -> set[NodeInfo]:
        """The groups of the connected sidecars: only these may veto a change."""
        with self.cond:
            return set(self.connected)

    def connected_in(self, groups: set[NodeInfo]) -> list[str]:
        """The ids of the connected sidecars of `groups`, in no order (sorting 10,000 ids for
        each registration under churn cost more than staging it)."""
        with self.cond:
            out: list[str] = []
            for g in groups:
                out.extend(self.connected.get(g, ()))
            return out

    def sweep(self) -> None:
        """Forget sidecars departed more than `forget_after` ago (and groups nobody uses)."""
        with self.cond:
            self._next_sweep = 0.0
            self._sweep(time.time())

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(1.0, self.limits.forget_after / 4)
        gone = [
            nid
            for nid, ns in self.nodes.items()
            if not ns.connected and now - ns.disconnected_at >= self.limits.forget_after
        ]
        self._forget(gone)

    def _evict_departed(self, count: int) -> None:
        departed = sorted(
            (ns.disconnected_at, nid) for nid, ns in self.nodes.items() if not ns.connected
        )
        self._forget([nid for _, nid in departed[:count]])

    def _forget(self, node_ids: list[str]) -> None:
        if not node_ids:
            return
        for nid in node_ids:
            del self.nodes[nid]
        if self._retain_groups is not None:
            self._retain_groups({ns.group for ns in self.nodes.values()})

    # -- read -----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        # Copy under the lock (cheap, shallow); build the document outside it, so a large
        # status never stalls the ADS streams that need this lock.
        with self.cond:
            now = time.time()
            self._sweep(now)
            rows = []
            for nid, ns in self.nodes.items():
                state, _, since = self._state(nid, self._latest)
                lagging = state == "pending" and self._lags(since, now)
                types = {tu: copy.copy(ts) for tu, ts in ns.types.items()}
                rows.append((nid, copy.copy(ns), types, lagging, since if lagging else None))
            conv = list(self.convergence)
            histogram = list(self.histogram)
            rejected = list(self.rejected)
        nodes = {}
        for nid, ns, types, lagging, since in rows:
            ns.types = {}
            d = asdict(ns)
            d["group"] = asdict(ns.group)
            d["types"] = {t.SHORT[tu]: asdict(ts) for tu, ts in types.items()}
            d["lagging"] = lagging
            d["behind_since"] = since
            nodes[nid] = d
        conv.sort()
        return {
            "nodes": nodes,
            "lagging": sorted(nid for nid, d in nodes.items() if d["lagging"]),
            "rejected": rejected,
            "convergence": {
                "count": len(conv),
                "p50_seconds": _quantile(conv, 0.5),
                "p99_seconds": _quantile(conv, 0.99),
                "buckets": [
                    {"le": "+Inf" if b == float("inf") else b, "count": c}
                    for b, c in zip(BUCKETS, histogram, strict=True)
                ],
            },
        }


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))

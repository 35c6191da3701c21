"""Sync status per sidecar and type: what was sent, what was ACKed, the last NACK, time to ACK;
and a convergence histogram (change staged -> every affected sidecar ACKed)."""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from xds_server import types as t
from xds_server.node import NodeInfo


@dataclass
class TypeSync:
    sent_version: str = ""
    sent_at: float = 0.0
    pushes: int = 0  # responses sent for this type on this node's streams
    acked_version: str = ""
    acked_at: float = 0.0
    ack_seconds: float | None = None  # time from the last send to its ACK
    nack_version: str = ""
    nack_error: str = ""
    nack_at: float = 0.0
    stale_nonces: int = 0


@dataclass
class NodeSync:
    node_id: str
    group: NodeInfo
    api: str  # "sotw" | "delta"
    connected: bool = True
    connected_at: float = field(default_factory=time.time)
    stream: int = 0
    error: str = ""  # why no snapshot could be built for this node
    types: dict[str, TypeSync] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)  # as the sidecar announced it


# Histogram bucket upper bounds, seconds.
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, float("inf"))


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
    done: threading.Event = field(default_factory=threading.Event)


class SyncStatus:
    """Thread-safe; written by the ADS streams, read by the API and /debug/syncz."""

    def __init__(
        self,
        expected: Callable[[NodeInfo, int], dict[str, int]],
        generation_of: Callable[[str], int],
    ) -> None:
        self._expected = expected
        self._generation_of = generation_of
        self.cond = threading.Condition()
        self.nodes: dict[str, NodeSync] = {}
        self._streams = 0
        self._trackers: dict[int, _Tracker] = {}
        self._waiters: list[_Waiter] = []
        self.histogram = [0] * len(BUCKETS)
        self.convergence: list[float] = []  # seconds, newest last (bounded)

    # -- written by streams -------------------------------------------------------------------
    def connect(
        self, node_id: str, group: NodeInfo, api: str, metadata: dict[str, Any] | None = None
    ) -> int:
        with self.cond:
            self._streams += 1
            old = self.nodes.get(node_id)
            ns = NodeSync(node_id=node_id, group=group, api=api, stream=self._streams)
            ns.metadata = dict(metadata or {})
            if old is not None:
                # A reconnect keeps the history of what this sidecar ACKed and rejected.
                ns.types = old.types
            self.nodes[node_id] = ns
            self.cond.notify_all()
            return ns.stream

    def disconnect(self, node_id: str, stream: int) -> None:
        with self.cond:
            ns = self.nodes.get(node_id)
            if ns is not None and ns.stream == stream:
                ns.connected = False
                self._progress(node_id, time.time())
            self.cond.notify_all()

    def set_error(self, node_id: str, error: str) -> None:
        with self.cond:
            if node_id in self.nodes:
                self.nodes[node_id].error = error
                self._progress(node_id, time.time())
            self.cond.notify_all()

    def sent(self, node_id: str, type_url: str, version: str) -> None:
        with self.cond:
            ts = self._type(node_id, type_url)
            ts.sent_version, ts.sent_at = version, time.time()
            ts.pushes += 1

    def stale(self, node_id: str, type_url: str) -> None:
        with self.cond:
            self._type(node_id, type_url).stale_nonces += 1

    def ack(self, node_id: str, type_url: str, version: str) -> None:
        with self.cond:
            ts = self._type(node_id, type_url)
            now = time.time()
            ts.acked_version, ts.acked_at = version, now
            if ts.sent_version == version and ts.sent_at:
                ts.ack_seconds = now - ts.sent_at
            self._progress(node_id, now)
            self.cond.notify_all()

    def nack(self, node_id: str, type_url: str, version: str, error: str) -> None:
        with self.cond:
            ts = self._type(node_id, type_url)
            ts.nack_version, ts.nack_error, ts.nack_at = version, error, time.time()
            self._progress(node_id, ts.nack_at)
            self.cond.notify_all()

    # -- convergence ----------------------------------------------------------------------------
    def track(self, generation: int, nodes: list[str]) -> None:
        """Start timing a change: it converges when every one of `nodes` holds it."""
        with self.cond:
            now = time.time()
            self._trackers[generation] = _Tracker(generation, now, set(nodes))
            for gen, tr in list(self._trackers.items()):
                if now - tr.started > 120:  # a sidecar that went away; stop waiting
                    del self._trackers[gen]
            self._progress(None, now)

    def state(self, node_id: str, generation: int) -> tuple[str, str]:
        """("acked" | "nacked" | "pending" | "disconnected", error) for one node."""
        with self.cond:
            return self._state(node_id, generation)

    def _state(self, node_id: str, generation: int) -> tuple[str, str]:
        ns = self.nodes.get(node_id)
        if ns is None or not ns.connected:
            return "disconnected", ""
        if ns.error:
            return "nacked", ns.error
        expected = self._expected(ns.group, generation)
        pending = False
        for tu, gen in expected.items():
            ts = ns.types.get(tu)
            if ts is None:
                pending = True
                continue
            if self._generation_of(ts.acked_version) >= gen:
                continue
            if ts.nack_error and self._generation_of(ts.nack_version) >= gen:
                return "nacked", f"{t.SHORT.get(tu, tu)} {ts.nack_version}: {ts.nack_error}"
            pending = True
        return ("pending" if pending else "acked"), ""

    def wait(
        self, generation: int, nodes: list[str], timeout: float
    ) -> tuple[list[str], dict[str, str], list[str]]:
        """Block until each node holds `generation` (ACKed it or later), rejected it, or went
        away, or `timeout` passed. Returns (acked, errors by node, missing). Each ACK re-checks
        only its own node, so waiting on thousands of sidecars stays linear."""
        w = _Waiter(generation, set(nodes))
        with self.cond:
            for n in list(w.remaining):
                self._settle(w, n)
            if w.remaining:
                self._waiters.append(w)
            else:
                w.done.set()
        w.done.wait(timeout)
        with self.cond:
            if w in self._waiters:
                self._waiters.remove(w)
            missing = sorted(set(nodes) - w.acked)
            return sorted(w.acked), dict(w.errors), missing

    def _settle(self, w: _Waiter, node_id: str) -> None:
        state, error = self._state(node_id, w.generation)
        if state == "acked":
            w.acked.add(node_id)
        elif state == "nacked":
            w.errors[node_id] = error
        elif state == "pending":
            return
        w.remaining.discard(node_id)

    def _progress(self, node_id: str | None, now: float) -> None:
        if node_id is not None:
            for w in list(self._waiters):
                if node_id in w.remaining:
                    self._settle(w, node_id)
                    if not w.remaining:
                        self._waiters.remove(w)
                        w.done.set()
        for gen, tr in list(self._trackers.items()):
            check = tr.remaining if node_id is None else tr.remaining & {node_id}
            for n in list(check):
                if self._state(n, gen)[0] in ("acked", "disconnected"):
                    tr.remaining.discard(n)
            if not tr.remaining:
                self._record(now - tr.started)
                del self._trackers[gen]

    def _record(self, seconds: float) -> None:
        self.histogram[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.convergence.append(seconds)
        del self.convergence[:-1000]

    def _type(self, node_id: str, type_url: str) -> TypeSync:
        return self.nodes[node_id].types.setdefault(type_url, TypeSync())

    # -- read -----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        with self.cond:
            nodes = {}
            for nid, ns in self.nodes.items():
                d = asdict(ns)
                d["group"] = asdict(ns.group)
                d["types"] = {t.SHORT.get(tu, tu): asdict(ts) for tu, ts in ns.types.items()}
                nodes[nid] = d
            conv = sorted(self.convergence)
            return {
                "nodes": nodes,
                "convergence": {
                    "count": len(conv),
                    "p50_seconds": _quantile(conv, 0.5),
                    "p99_seconds": _quantile(conv, 0.99),
                    "buckets": [
                        {"le": "+Inf" if b == float("inf") else b, "count": c}
                        for b, c in zip(BUCKETS, self.histogram, strict=True)
                    ],
                },
            }


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(q * len(xs)))]

"""ADS on grpc.aio: `StreamAggregatedResources` (state of the world) and
`DeltaAggregatedResources` (incremental).

One coroutine per stream: a reader task handles each request as it comes and wakes the writer
only when the request may change what the stream is sent (an ACK does not); the writer also wakes
when the cache publishes. The writer answers in push order (CDS, EDS, LDS, ECDS, RDS) and holds
back the removal of clusters until the listeners and routes that stop using them are ACKed
(make before break). A response that many streams are sent alike is built and serialized once
(xds/wire.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2, json_format

from mesh_common import type_urls as t
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.node import NodeInfo
from xds_server.xds.peer import Peer, claim_refused, peer_of
from xds_server.xds.snapshot import Resources, Snapshot
from xds_server.xds.sync import NodeRejected, SyncStatus
from xds_server.xds.wire import with_nonce

log = logging.getLogger(__name__)
# Types that must be ACKed at the snapshot's version before stale clusters are dropped.
_USERS_OF_CLUSTERS = (t.LISTENER, t.EXTENSION_CONFIG, t.ROUTE)
# Delta nonces a stream remembers while they are neither ACKed nor NACKed; older ones are stale.
_MAX_OUTSTANDING_NONCES = 64
_STOPPING = "control plane stopping"
# Shared responses kept per resource set (one per subscription a group's sidecars use).
_MAX_SHARED = 64
_KEEP = "~keep-"  # marks a transitional CDS version (make before break)
_NOTHING: Mapping = MappingProxyType({})


class AdsServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(
        self, cache: SnapshotCache, sync: SyncStatus, trust_domain: str | None = None
    ) -> None:
        """`trust_domain`: ADS is served over mTLS, and each stream's node metadata is checked
        against the workload identity of its client certificate (xds_server/xds/peer.py)."""
        self.cache = cache
        self.sync = sync
        self.trust_domain = trust_domain
        self._streams: set[_Stream] = set()
        self._admission = Admission()
        self._closing = False
        self._all_closed: asyncio.Event | None = None

    async def StreamAggregatedResources(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        async for resp in self._serve(SotwStream, request_iterator, context):
            yield resp

    async def DeltaAggregatedResources(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DeltaDiscoveryResponse]:
        async for resp in self._serve(DeltaStream, request_iterator, context):
            yield resp

    async def close(self, timeout: float = 2.0) -> None:
        """End every open stream with UNAVAILABLE (Envoy keeps its config and reconnects to
        whichever control plane answers) and refuse new ones; returns once they ended, so the
        gRPC server stops with no stream left for it to cancel."""
        self._closing = True
        if not self._streams:
            return
        self._all_closed = asyncio.Event()
        for stream in list(self._streams):
            stream.close()
        try:
            await asyncio.wait_for(self._all_closed.wait(), timeout)
        except TimeoutError:
            log.warning("ADS: %d stream(s) still open at stop", len(self._streams))

    async def _serve(
        self, kind: type[_Stream], requests: AsyncIterator, context: grpc.aio.ServicerContext
    ) -> AsyncIterator:
        await self._admission.wait(self.sync.limits.admit_per_s)
        if self._closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _STOPPING)
        stream = kind(self.cache, self.sync, self._peer(context))
        self._streams.add(stream)
        try:
            async for resp in stream.run(requests):
                yield resp
        except NodeRejected as e:
            await _close(context, e)
        finally:
            self._streams.discard(stream)
            if not self._streams and self._all_closed is not None:
                self._all_closed.set()
        if stream.closed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _STOPPING)

    def _peer(self, context: grpc.aio.ServicerContext) -> Peer | None:
        return peer_of(context, self.trust_domain) if self.trust_domain else None


class _Wake:
    """An asyncio.Event for its one waiter, cleared as it returns, without the Event's deque
    of waiters (one per stream: thousands). Made and used on the loop's thread."""

    __slots__ = ("_loop", "_set", "_waiter")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._set = False
        self._waiter: asyncio.Future | None = None

    def set(self) -> None:
        self._set = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        if not self._set:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._set = False


class Admission:
    """New streams taken up at most `rate` a second, after a burst of as many: each takes the
    next free slot of a schedule that runs at most a second behind the clock, and waits for
    it. O(1) a stream, and a stream that waits holds nothing but its coroutine."""

    def __init__(self) -> None:
        self._next = 0.0

    async def wait(self, rate: float) -> None:
        now = time.monotonic()
        slot = max(self._next, now - 1.0)
        self._next = slot + 1.0 / rate
        if slot > now:
            await asyncio.sleep(slot - now)


_last_warning = 0.0


async def _close(context: grpc.aio.ServicerContext, e: NodeRejected) -> None:
    # At most one warning a second: a client retrying a rejected stream must not flood the log
    # (every rejection is in /debug/syncz "rejected" too).
    global _last_warning
    now = time.monotonic()
    level = logging.WARNING if now - _last_warning >= 1.0 else logging.DEBUG
    if level == logging.WARNING:
        _last_warning = now
    log.log(level, "ADS stream rejected: %s", e)
    e.__traceback__ = None  # its frames hold the stream's last request
    await context.abort(grpc.StatusCode[e.code], str(e))


@dataclass(slots=True)  # one per type per stream: thousands
class _TypeState:
    requested: bool = False
    sent_version: str = ""
    acked_version: str = ""
    outstanding: bool = False  # a response not yet ACKed or NACKed
    # SotW
    names: frozenset[str] | None = None  # None: wildcard
    sent_names: frozenset[str] | None = None
    sent_items: Mapping[str, any_pb2.Any] = field(default_factory=lambda: _NOTHING)  # replaced
    nonce: str = ""
    # Delta
    known: dict[str, str] = field(default_factory=dict)  # what the client holds: name -> hash
    # Frozen (replaced on each change, which is rare): the shared-response key as it is, and an
    # empty one costs nothing per stream.
    subscribed: frozenset[str] = frozenset()
    wildcard: bool = False
    absent_told: frozenset[str] = frozenset()
    nonces: dict[str, str] = field(default_factory=dict)  # nonce -> system version
    # The version whose resources (as far as subscribed) `known` holds exactly and only; None
    # once anything else changed `known`. Streams in the same state get the same response.
    synced: str | None = None


class _Stream:
    api = ""
    # One per sidecar: no instance dict.
    __slots__ = (
        "_answered", "_claim_checked", "_done", "_epoch", "_error_shown", "_failure", "_nonce",
        "_replies", "_wake", "cache", "closed", "group", "node_id", "peer", "stream_id", "sync",
        "types",
    )  # fmt: skip

    def __init__(self, cache: SnapshotCache, sync: SyncStatus, peer: Peer | None = None) -> None:
        self.cache = cache
        self.sync = sync
        self.peer = peer  # None: plaintext ADS, the metadata is taken on trust
        self._claim_checked: object = None  # the mesh the node's claim was last checked against
        self.node_id: str | None = None
        self.group: NodeInfo | None = None
        self.stream_id = 0
        self.types: dict[str, _TypeState] = {}
        self._replies: list = []  # answers to requests for types this server does not serve
        self._failure: NodeRejected | None = None  # a request the reader refused
        # Bumped by each request that may change what is sent; with the snapshot answered, it
        # tells the writer when there is nothing new to compute.
        self._epoch = 0
        self._answered: tuple[Snapshot | None, int] = (None, -1)
        self._error_shown = False
        self._wake = _Wake()
        self._done = False
        self.closed = False  # ended by close(): the control plane is stopping
        self._nonce = 0

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    async def run(self, requests: AsyncIterator) -> AsyncIterator:
        loop = asyncio.get_running_loop()
        loop_thread = threading.get_ident()

        def wake() -> None:
            # A publish on the loop's own thread (the debouncer's) wakes the stream directly:
            # call_soon_threadsafe writes to the loop's self-pipe once per stream. (The thread's
            # id, not get_running_loop(), which makes a getpid call each time.)
            if threading.get_ident() == loop_thread:
                self._wake.set()
            else:
                loop.call_soon_threadsafe(self._wake.set)

        unwatch = self.cache.watch(wake)
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                await self._wake.wait()
                if self.closed:
                    break
                if self._failure is not None:
                    raise self._failure
                if self._done:
                    break
                while self._replies:
                    yield self._replies.pop(0)
                if self.group is None:
                    continue
                self._check_claim()
                snap = self.cache.snapshot(self.group)
                if snap is None:
                    self.sync.set_error(self.node_id, self.cache.error(self.group) or "")
                    self._error_shown = True
                    continue
                if self._error_shown:  # the group builds again: the old error is gone
                    self.sync.set_error(self.node_id, "")
                    self._error_shown = False
                if self._answered[0] is snap and self._answered[1] == self._epoch:
                    continue
                self._answered = (snap, self._epoch)
                for resp in self._responses(snap):
                    yield resp
        finally:
            unwatch()
            reader.cancel()
            self.types.clear()
            if self.stream_id:  # a rejected stream never held its node id
                self.sync.disconnect(self.node_id, self.stream_id)

    async def _read(self, requests: AsyncIterator) -> None:
        try:
            async for req in requests:
                if self._failure is not None:
                    continue  # refused: read and dropped until the writer ends the stream
                try:
                    changes = self._handle(req)
                except NodeRejected as e:
                    e.__traceback__ = None  # its frames hold the request: let go of it now
                    self._failure = e
                    changes = True
                if changes:
                    self._epoch += 1
                    self._wake.set()
                req = None  # not held while the next one is awaited
        except (grpc.RpcError, asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        finally:
            self._done = True
            self._wake.set()

    def _identify(self, req: object) -> None:
        """Admit the node the first request names; raises NodeRejected (closing the stream)
        for an id held by a live stream, oversized or malformed metadata, or a full table."""
        if self.node_id is not None or not req.HasField("node"):
            return
        node_id = req.node.id
        self.sync.check_node(node_id, req.node.metadata.ByteSize())
        metadata = json_format.MessageToDict(req.node.metadata)
        try:
            group = NodeInfo.from_metadata(metadata).with_locality(req.node).interned()
        except ValueError as e:
            raise NodeRejected("INVALID_ARGUMENT", str(e)) from None
        self._check_claim(node_id, group)
        spiffe_id = self.peer.spiffe_id if self.peer else ""
        self.stream_id = self.sync.connect(node_id, group, self.api, metadata, spiffe_id)
        self.node_id, self.group = node_id, group

    def _check_claim(self, node_id: str | None = None, group: NodeInfo | None = None) -> None:
        """PERMISSION_DENIED when the peer's identity may not be this node; checked again
        whenever the mesh changed (a service may get another service account)."""
        mesh = self.cache.mesh
        if self.peer is None or mesh is self._claim_checked:
            return
        node_id, group = node_id or self.node_id, group or self.group
        refused = claim_refused(node_id, group, self.peer, mesh)
        if refused:
            self.sync.reject(node_id, "PERMISSION_DENIED", refused)
        self._claim_checked = mesh

    def _check_names(self, tu: str, count: int, names: Iterable[str]) -> None:
        """INVALID_ARGUMENT (closing the stream) for more than `max_resource_names` names of
        one type or a name over `max_resource_name_bytes`; `count` is checked first, so an
        oversized request costs no more than its own message."""
        lim = self.sync.limits
        if count > lim.max_resource_names:
            self.sync.reject(
                self.node_id or "",
                "INVALID_ARGUMENT",
                f"{t.SHORT[tu]}: more than {lim.max_resource_names} resource names "
                "(max_resource_names)",
            )
        for n in names:
            size = len(n.encode())
            if size > lim.max_resource_name_bytes:
                self.sync.reject(
                    self.node_id or "",
                    "INVALID_ARGUMENT",
                    f"{t.SHORT[tu]}: a resource name of {size} bytes is over the limit of "
                    f"{lim.max_resource_name_bytes} (max_resource_name_bytes)",
                )

    def _unknown_type(self, tu: str, first: bool) -> bool:
        """True (and, for a first request, an empty answer queued) when this server does not
        serve `tu`: nothing is kept for it, so made-up type URLs cost no memory."""
        if tu in t.SHORT:
            return False
        if first and len(self._replies) < _MAX_OUTSTANDING_NONCES:  # a client not reading
            self._replies.append(self._empty_reply(tu))
        return True

    def _empty_reply(self, tu: str) -> object:
        raise NotImplementedError

    def _next_nonce(self) -> str:
        self._nonce += 1
        return str(self._nonce)

    def _holds_clusters(self) -> bool:
        """True while clusters wait for ACKs before they go: an ACK may let them go."""
        ts = self.types.get(t.CLUSTER)
        return ts is not None and _KEEP in ts.sent_version

    def _ready_to_drop_clusters(self, snap: Snapshot) -> bool:
        for tu in _USERS_OF_CLUSTERS:
            ts = self.types.get(tu)
            if ts is not None and ts.requested and ts.acked_version != snap.version(tu):
                return False
        return True

    def _handle(self, req: object) -> bool:
        """Take in one request; False when it cannot change what the stream is sent."""
        raise NotImplementedError

    def _responses(self, snap: Snapshot) -> list:
        raise NotImplementedError


class SotwStream(_Stream):
    api = "sotw"
    __slots__ = ()

    def _handle(self, req: discovery_pb2.DiscoveryRequest) -> bool:
        self._identify(req)
        if self.node_id is None:
            return True
        tu = req.type_url
        if self._unknown_type(tu, first=not req.response_nonce):
            return True
        self._check_names(tu, len(req.resource_names), req.resource_names)
        ts = self.types.setdefault(tu, _TypeState())
        # A request that answers an older response than our latest is stale: ignore it
        # (envoy#10363); the reply to the latest one follows.
        if req.response_nonce and req.response_nonce != ts.nonce:
            self.sync.stale(self.node_id, tu)
            return False
        answer = bool(req.response_nonce)
        if answer and ts.outstanding:
            ts.outstanding = False
            if req.HasField("error_detail"):
                # NACK: Envoy keeps its last good config. We keep sent_version, so the rejected
                # version is never sent again; only a newer one is (go-control-plane #582).
                self.sync.nack(self.node_id, tu, ts.sent_version, req.error_detail.message)
                answer = False
            else:
                ts.acked_version = ts.sent_version
                self.sync.ack(self.node_id, tu, ts.sent_version)
        names = frozenset(req.resource_names)
        wildcard = tu in t.WILDCARD_TYPES and (not names or "*" in names)
        names = None if wildcard else names
        if answer and ts.requested and names == ts.names:  # an ACK: nothing else changed
            return self._holds_clusters()
        ts.requested = True
        ts.names = names
        return True

    def _empty_reply(self, tu: str) -> discovery_pb2.DiscoveryResponse:
        return discovery_pb2.DiscoveryResponse(type_url=tu, nonce=self._next_nonce())

    def _responses(self, snap: Snapshot) -> list[discovery_pb2.DiscoveryResponse]:
        out = []
        for tu in t.PUSH_ORDER:
            ts = self.types.get(tu)
            if ts is None or not ts.requested:
                continue
            version, items, shared = self._desired(tu, ts, snap)
            if version == ts.sent_version and ts.names == ts.sent_names:
                continue
            if shared is None:  # held-back clusters or their endpoints: this stream's own
                body = self._sotw_body(tu, version, items)
            else:
                body, items = shared
            nonce = self._next_nonce()
            out.append(with_nonce(body, nonce))
            ts.sent_version, ts.sent_names, ts.sent_items = version, ts.names, items
            ts.nonce, ts.outstanding = nonce, True
            self.sync.sent(self.node_id, tu, version)
        return out

    def _desired(
        self, tu: str, ts: _TypeState, snap: Snapshot
    ) -> tuple[str, dict, tuple[bytes, dict] | None]:
        """(version, items, shared): `shared` is the (body, items) every stream with these
        names is sent, or None when this stream's response is its own."""
        res = snap.get(tu)
        if tu == t.CLUSTER:
            stale = {n: a for n, a in ts.sent_items.items() if n not in res.items}
            if stale and not self._ready_to_drop_clusters(snap):
                items = dict(res.items) | stale
                return _transitional(res.version, stale), self._named(ts, items), None
        elif tu == t.ENDPOINT and any(n not in res.items for n in ts.sent_items):
            # Clusters kept for make-before-break still need their endpoints.
            items = dict(ts.sent_items) | res.items
            return res.version, self._named(ts, items), None
        shared = res.shared.get(ts.names)
        if shared is None:
            items = self._named(ts, res.items)
            shared = (self._sotw_body(tu, res.version, items), items)
            _share(res, ts.names, shared)
        return res.version, shared[1], shared

    @staticmethod
    def _named(ts: _TypeState, items: dict) -> dict:
        if ts.names is None:
            return dict(items)
        return {n: a for n, a in items.items() if n in ts.names}

    @staticmethod
    def _sotw_body(tu: str, version: str, items: dict) -> bytes:
        return discovery_pb2.DiscoveryResponse(
            version_info=version, type_url=tu, resources=list(items.values())
        ).SerializeToString()


class DeltaStream(_Stream):
    api = "delta"
    __slots__ = ()

    def _handle(self, req: discovery_pb2.DeltaDiscoveryRequest) -> bool:
        self._identify(req)
        if self.node_id is None:
            return True
        tu = req.type_url
        if self._unknown_type(tu, first=not req.response_nonce):
            return True
        ts = self.types.get(tu)
        if ts is not None and not (
            req.resource_names_subscribe or req.resource_names_unsubscribe
        ):  # an ACK or NACK, nothing else
            self._answer(tu, ts, req)
            return not req.response_nonce or self._holds_clusters()
        self._check_names(tu, len(req.resource_names_subscribe), req.resource_names_subscribe)
        self._check_names(tu, len(req.initial_resource_versions), req.initial_resource_versions)
        if ts is None:
            ts = self.types[tu] = _TypeState()
            ts.known = dict(req.initial_resource_versions)
            ts.wildcard = tu in t.WILDCARD_TYPES and not req.resource_names_subscribe
        ts.requested = True
        ts.synced = None
        subscribed = set(ts.subscribed)
        for n in req.resource_names_subscribe:
            if n == "*":
                ts.wildcard = True
            else:
                subscribed.add(n)
        for n in req.resource_names_unsubscribe:
            if n == "*":
                ts.wildcard = False
            else:
                subscribed.discard(n)
                ts.known.pop(n, None)  # a later subscribe must send it again
                if n in ts.absent_told:
                    ts.absent_told = ts.absent_told - {n}
        ts.subscribed = frozenset(subscribed)
        self._check_names(tu, max(len(ts.subscribed), len(ts.known)), ())
        self._answer(tu, ts, req)
        return True

    def _answer(self, tu: str, ts: _TypeState, req: discovery_pb2.DeltaDiscoveryRequest) -> None:
        if not req.response_nonce:
            return
        version = ts.nonces.pop(req.response_nonce, None)
        if version is None:
            self.sync.stale(self.node_id, tu)
        elif req.HasField("error_detail"):
            # `known` already holds what we sent, so a NACKed resource is not resent
            # until its content changes.
            self.sync.nack(self.node_id, tu, version, req.error_detail.message)
        else:
            ts.acked_version = version
            self.sync.ack(self.node_id, tu, version)
        ts.outstanding = bool(ts.nonces)

    def _empty_reply(self, tu: str) -> discovery_pb2.DeltaDiscoveryResponse:
        return discovery_pb2.DeltaDiscoveryResponse(type_url=tu, nonce=self._next_nonce())

    def _responses(self, snap: Snapshot) -> list[bytes]:
        out = []
        for tu in t.PUSH_ORDER:
            ts = self.types.get(tu)
            if ts is None or not ts.requested:
                continue
            res = snap.get(tu)
            diff = None
            if ts.synced is not None:
                diff = res.shared.get((ts.synced, ts.wildcard, ts.subscribed))
            if diff is None:
                diff = self._diff(tu, ts, res, snap)
            body, changed, removed, version, exact = diff
            ts.known.update(changed)
            for n in removed:
                ts.known.pop(n, None)
            ts.synced = version if exact else None
            if body is None:
                if version and version != ts.sent_version:
                    # Nothing this sidecar holds changed: it is at this version already.
                    ts.sent_version = ts.acked_version = version
                    self.sync.sent(self.node_id, tu, version)
                    self.sync.ack(self.node_id, tu, version)
                continue
            nonce = self._next_nonce()
            out.append(with_nonce(body, nonce))
            ts.nonces[nonce] = version
            if len(ts.nonces) > _MAX_OUTSTANDING_NONCES:
                del ts.nonces[next(iter(ts.nonces))]
            ts.sent_version, ts.outstanding = version, True
            self.sync.sent(self.node_id, tu, version)
        return out

    def _diff(self, tu: str, ts: _TypeState, res: Resources, snap: Snapshot) -> _Diff:
        """What this stream is sent for `res`. Shared with every stream in the same state
        (same version held exactly, same subscription) when nothing in it is this stream's
        own: no held-back clusters, no names told absent, nothing held beyond the
        subscription."""
        visible = (lambda n: True) if ts.wildcard else ts.subscribed.__contains__
        changed = {n: h for n, h in res.hashes.items() if visible(n) and ts.known.get(n) != h}
        removed = [n for n in ts.known if n not in res.items]
        version = res.version
        if tu == t.CLUSTER and removed and not self._ready_to_drop_clusters(snap):
            version = _transitional(res.version, dict.fromkeys(removed))
            removed = []
        # Subscribed names that do not exist: say so, or Envoy waits for them.
        absent = [
            n
            for n in ts.subscribed
            if n not in res.items and n not in ts.known and n not in ts.absent_told
        ]
        if absent:
            ts.absent_told = ts.absent_told | frozenset(absent)
        body = None
        if changed or removed or absent:
            body = discovery_pb2.DeltaDiscoveryResponse(
                system_version_info=version,
                type_url=tu,
                resources=[
                    discovery_pb2.Resource(name=n, version=h, resource=res.items[n])
                    for n, h in changed.items()
                ],
                removed_resources=removed + absent,
            ).SerializeToString()
        exact = (
            not absent
            and _KEEP not in version
            and not any(n in res.items and not visible(n) for n in ts.known)
        )
        diff = (body, changed, removed, version, exact)
        if exact and ts.synced is not None:
            _share(res, (ts.synced, ts.wildcard, ts.subscribed), diff)
        return diff


# A delta stream's response for one type: (body without a nonce, or None when there is nothing
# to send; changed name -> hash; removed names; version; whether the stream then holds exactly
# that version).
_Diff = tuple[bytes | None, dict[str, str], list[str], str, bool]


def _share(res: Resources, key: object, value: object) -> None:
    if not res.version:  # EMPTY: one object for every type and group, so nothing is shared
        return
    if len(res.shared) >= _MAX_SHARED:
        res.shared.clear()
    res.shared[key] = value


def _transitional(version: str, kept: dict) -> str:
    """A version for a CDS that still carries clusters about to go; never a plain version, so
    it never counts as converged."""
    digest = hashlib.sha256("\0".join(sorted(kept)).encode()).hexdigest()[:8]
    return f"{version}~keep-{digest}"

"""ADS on grpc.aio: `StreamAggregatedResources` (state of the world) and
`DeltaAggregatedResources` (incremental).

One coroutine per stream: a reader task queues requests and wakes the writer, which also wakes
when the cache publishes. The writer answers in push order (CDS, EDS, LDS, ECDS, RDS) and holds
back the removal of clusters until the listeners and routes that stop using them are ACKed
(make before break).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2, json_format

from mesh_common import type_urls as t
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.node import NodeInfo
from xds_server.xds.peer import Peer, claim_refused, peer_of
from xds_server.xds.snapshot import Snapshot
from xds_server.xds.sync import NodeRejected, SyncStatus

log = logging.getLogger(__name__)
# Types that must be ACKed at the snapshot's version before stale clusters are dropped.
_USERS_OF_CLUSTERS = (t.LISTENER, t.EXTENSION_CONFIG, t.ROUTE)
# Delta nonces a stream remembers while they are neither ACKed nor NACKed; older ones are stale.
_MAX_OUTSTANDING_NONCES = 64
_STOPPING = "control plane stopping"


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


@dataclass
class _TypeState:
    requested: bool = False
    sent_version: str = ""
    acked_version: str = ""
    outstanding: bool = False  # a response not yet ACKed or NACKed
    # SotW
    names: frozenset[str] | None = None  # None: wildcard
    sent_names: frozenset[str] | None = None
    sent_items: dict[str, any_pb2.Any] = field(default_factory=dict)
    nonce: str = ""
    # Delta
    known: dict[str, str] = field(default_factory=dict)  # what the client holds: name -> hash
    subscribed: set[str] = field(default_factory=set)
    wildcard: bool = False
    absent_told: set[str] = field(default_factory=set)
    nonces: dict[str, str] = field(default_factory=dict)  # nonce -> system version


class _Stream:
    api = ""

    def __init__(self, cache: SnapshotCache, sync: SyncStatus, peer: Peer | None = None) -> None:
        self.cache = cache
        self.sync = sync
        self.peer = peer  # None: plaintext ADS, the metadata is taken on trust
        self._claim_checked: object = None  # the mesh the node's claim was last checked against
        self.node_id: str | None = None
        self.group: NodeInfo | None = None
        self.stream_id = 0
        self.types: dict[str, _TypeState] = {}
        self._inbox: collections.deque = collections.deque()
        self._replies: list = []  # answers to requests for types this server does not serve
        self._error_shown = False
        self._wake = asyncio.Event()
        self._done = False
        self.closed = False  # ended by close(): the control plane is stopping
        self._nonce = 0

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    async def run(self, requests: AsyncIterator) -> AsyncIterator:
        loop = asyncio.get_running_loop()

        def wake() -> None:
            # A publish on the loop's own thread (the debouncer's) wakes the stream directly:
            # call_soon_threadsafe writes to the loop's self-pipe once per stream.
            if _running_loop() is loop:
                self._wake.set()
            else:
                loop.call_soon_threadsafe(self._wake.set)

        unwatch = self.cache.watch(wake)
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self.closed:
                    break
                while self._inbox:
                    self._handle(self._inbox.popleft())
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
                for resp in self._responses(snap):
                    yield resp
        finally:
            unwatch()
            reader.cancel()
            # Let go of the requests now: a rejected stream's frames outlive it in a traceback.
            self._inbox.clear()
            self.types.clear()
            if self.stream_id:  # a rejected stream never held its node id
                self.sync.disconnect(self.node_id, self.stream_id)

    async def _read(self, requests: AsyncIterator) -> None:
        try:
            async for req in requests:
                self._inbox.append(req)
                self._wake.set()
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
            group = NodeInfo.from_metadata(metadata).with_locality(req.node)
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

    def _ready_to_drop_clusters(self, snap: Snapshot) -> bool:
        for tu in _USERS_OF_CLUSTERS:
            ts = self.types.get(tu)
            if ts is not None and ts.requested and ts.acked_version != snap.version(tu):
                return False
        return True

    def _handle(self, req: object) -> None:
        raise NotImplementedError

    def _responses(self, snap: Snapshot) -> list:
        raise NotImplementedError


class SotwStream(_Stream):
    api = "sotw"

    def _handle(self, req: discovery_pb2.DiscoveryRequest) -> None:
        self._identify(req)
        if self.node_id is None:
            return
        tu = req.type_url
        if self._unknown_type(tu, first=not req.response_nonce):
            return
        self._check_names(tu, len(req.resource_names), req.resource_names)
        ts = self.types.setdefault(tu, _TypeState())
        # A request that answers an older response than our latest is stale: ignore it
        # (envoy#10363); the reply to the latest one follows.
        if req.response_nonce and req.response_nonce != ts.nonce:
            self.sync.stale(self.node_id, tu)
            return
        if req.response_nonce and ts.outstanding:
            ts.outstanding = False
            if req.HasField("error_detail"):
                # NACK: Envoy keeps its last good config. We keep sent_version, so the rejected
                # version is never sent again; only a newer one is (go-control-plane #582).
                self.sync.nack(self.node_id, tu, ts.sent_version, req.error_detail.message)
            else:
                ts.acked_version = ts.sent_version
                self.sync.ack(self.node_id, tu, ts.sent_version)
        ts.requested = True
        names = frozenset(req.resource_names)
        wildcard = tu in t.WILDCARD_TYPES and (not names or "*" in names)
        ts.names = None if wildcard else names

    def _empty_reply(self, tu: str) -> discovery_pb2.DiscoveryResponse:
        return discovery_pb2.DiscoveryResponse(type_url=tu, nonce=self._next_nonce())

    def _responses(self, snap: Snapshot) -> list[discovery_pb2.DiscoveryResponse]:
        out = []
        for tu in t.PUSH_ORDER:
            ts = self.types.get(tu)
            if ts is None or not ts.requested:
                continue
            version, items = self._desired(tu, ts, snap)
            if version == ts.sent_version and ts.names == ts.sent_names:
                continue
            nonce = self._next_nonce()
            out.append(
                discovery_pb2.DiscoveryResponse(
                    version_info=version, type_url=tu, resources=list(items.values()), nonce=nonce
                )
            )
            ts.sent_version, ts.sent_names, ts.sent_items = version, ts.names, items
            ts.nonce, ts.outstanding = nonce, True
            self.sync.sent(self.node_id, tu, version)
        return out

    def _desired(self, tu: str, ts: _TypeState, snap: Snapshot) -> tuple[str, dict]:
        res = snap.get(tu)
        items = dict(res.items)
        version = res.version
        if tu == t.CLUSTER:
            stale = {n: a for n, a in ts.sent_items.items() if n not in items}
            if stale and not self._ready_to_drop_clusters(snap):
                items.update(stale)
                version = _transitional(res.version, stale)
        elif tu == t.ENDPOINT:
            # Clusters kept for make-before-break still need their endpoints.
            for n, a in ts.sent_items.items():
                items.setdefault(n, a)
        if ts.names is not None:
            items = {n: a for n, a in items.items() if n in ts.names}
        return version, items


class DeltaStream(_Stream):
    api = "delta"

    def _handle(self, req: discovery_pb2.DeltaDiscoveryRequest) -> None:
        self._identify(req)
        if self.node_id is None:
            return
        tu = req.type_url
        if self._unknown_type(tu, first=not req.response_nonce):
            return
        self._check_names(tu, len(req.resource_names_subscribe), req.resource_names_subscribe)
        self._check_names(tu, len(req.initial_resource_versions), req.initial_resource_versions)
        ts = self.types.get(tu)
        if ts is None:
            ts = self.types[tu] = _TypeState()
            ts.known = dict(req.initial_resource_versions)
            ts.wildcard = tu in t.WILDCARD_TYPES and not req.resource_names_subscribe
        ts.requested = True
        for n in req.resource_names_subscribe:
            if n == "*":
                ts.wildcard = True
            else:
                ts.subscribed.add(n)
        for n in req.resource_names_unsubscribe:
            if n == "*":
                ts.wildcard = False
            else:
                ts.subscribed.discard(n)
                ts.known.pop(n, None)  # a later subscribe must send it again
                ts.absent_told.discard(n)
        self._check_names(tu, max(len(ts.subscribed), len(ts.known)), ())
        if req.response_nonce:
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

    def _responses(self, snap: Snapshot) -> list[discovery_pb2.DeltaDiscoveryResponse]:
        out = []
        for tu in t.PUSH_ORDER:
            ts = self.types.get(tu)
            if ts is None or not ts.requested:
                continue
            res = snap.get(tu)
            changed = [
                discovery_pb2.Resource(name=n, version=res.hashes[n], resource=a)
                for n, a in res.items.items()
                if (ts.wildcard or n in ts.subscribed) and ts.known.get(n) != res.hashes[n]
            ]
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
            if not changed and not removed and not absent:
                if version and version != ts.sent_version:
                    # Nothing this sidecar holds changed: it is at this version already.
                    ts.sent_version = ts.acked_version = version
                    self.sync.sent(self.node_id, tu, version)
                    self.sync.ack(self.node_id, tu, version)
                continue
            nonce = self._next_nonce()
            out.append(
                discovery_pb2.DeltaDiscoveryResponse(
                    system_version_info=version,
                    type_url=tu,
                    resources=changed,
                    removed_resources=removed + absent,
                    nonce=nonce,
                )
            )
            for r in changed:
                ts.known[r.name] = r.version
            for n in removed:
                del ts.known[n]
            ts.absent_told.update(absent)
            ts.nonces[nonce] = version
            if len(ts.nonces) > _MAX_OUTSTANDING_NONCES:
                del ts.nonces[next(iter(ts.nonces))]
            ts.sent_version, ts.outstanding = version, True
            self.sync.sent(self.node_id, tu, version)
        return out


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _transitional(version: str, kept: dict) -> str:
    """A version for a CDS that still carries clusters about to go; never a plain version, so
    it never counts as converged."""
    digest = hashlib.sha256("\0".join(sorted(kept)).encode()).hexdigest()[:8]
    return f"{version}~keep-{digest}"

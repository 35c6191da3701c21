"""CSDS (envoy.service.status.v3.ClientStatusDiscoveryService) on the ADS port: for
each connected sidecar, every resource the control plane holds for it with the version last
sent and whether the sidecar ACKed or NACKed it, as `istioctl proxy-status` reads.

config_status is the server's view (csds.proto): SYNCED when the sidecar ACKed the current
version, NOT_SENT when the current version has not gone out yet, STALE when it went out and no
answer came, ERROR when it was NACKed (error_state carries the NACK's detail).
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import re2
from envoy.admin.v3 import config_dump_shared_pb2 as cd
from envoy.config.core.v3 import base_pb2
from envoy.service.status.v3 import csds_pb2, csds_pb2_grpc
from envoy.type.matcher.v3 import node_pb2
from google.protobuf import any_pb2, json_format, timestamp_pb2

from xds_server.xds.cache import SnapshotCache
from xds_server.xds.sync import NodeSync, SyncStatus, TypeSync

ConfigStatus = csds_pb2.ConfigStatus
# Bounds on one request's work: matchers are tried on every connected node id, and a regex's
# compiled size is capped as Envoy caps it (re2.max_program_size.error_level).
MAX_NODE_MATCHERS = 64
MAX_REGEX_PROGRAM_SIZE = 100
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # RE2 would print the (caller's) pattern to stderr
# Configs that carry plaintext credentials (native authz mode): CSDS and the admin API's config
# dump are readable without the admin token, so their secrets are shown as Envoy shows
# sensitive fields.
_SECRET_FIELDS = {"ApiKeyAuth": "credentials", "ApiKeyAuthPerRoute": "credentials"}


class BadRequest(ValueError):
    """A request this server cannot answer: INVALID_ARGUMENT, naming the field."""


class CsdsServicer(csds_pb2_grpc.ClientStatusDiscoveryServiceServicer):
    def __init__(self, cache: SnapshotCache, sync: SyncStatus) -> None:
        self.cache = cache
        self.sync = sync

    async def FetchClientStatus(
        self, request: csds_pb2.ClientStatusRequest, context: grpc.aio.ServicerContext
    ) -> csds_pb2.ClientStatusResponse:
        try:
            return self.status(request)
        except BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def StreamClientStatus(
        self,
        request_iterator: AsyncIterator[csds_pb2.ClientStatusRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[csds_pb2.ClientStatusResponse]:
        async for request in request_iterator:
            try:
                yield self.status(request)
            except BadRequest as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def status(self, request: csds_pb2.ClientStatusRequest) -> csds_pb2.ClientStatusResponse:
        """One ClientConfig per connected sidecar the request's node matchers select (all when
        it has none)."""
        if len(request.node_matchers) > MAX_NODE_MATCHERS:
            raise BadRequest(
                f"node_matchers: {len(request.node_matchers)} given, at most {MAX_NODE_MATCHERS}"
            )
        matchers = [_matcher(i, m) for i, m in enumerate(request.node_matchers)]
        # Match outside the ADS lock, then copy the chosen nodes' state under it.
        with self.sync.cond:
            connected = [nid for nid, ns in self.sync.nodes.items() if ns.connected]
        chosen = [nid for nid in connected if not matchers or any(f(nid) for f in matchers)]
        with self.sync.cond:
            nodes = [
                (ns.node_id, ns.group, ns.metadata, _copy_types(ns))
                for ns in map(self.sync.nodes.get, chosen)
                if ns is not None and ns.connected
            ]
        groups = self.cache.groups()
        out = csds_pb2.ClientStatusResponse()
        for node_id, group, metadata, types in sorted(nodes, key=lambda n: n[0]):
            config = out.config.add()
            config.node.CopyFrom(_node(node_id, metadata))
            snap = groups.get(group)
            for tu, ts in sorted(types.items()):
                res = snap.get(tu) if snap is not None else None
                for name, resource in sorted(res.items.items()) if res is not None else ():
                    config.generic_xds_configs.append(
                        _generic(
                            tu, name, resource, ts, res.version, request.exclude_resource_contents
                        )
                    )
        return out


def _copy_types(ns: NodeSync) -> dict[str, TypeSync]:
    return {tu: copy.copy(ts) for tu, ts in ns.types.items() if ts.sent_version}


def _node(node_id: str, metadata: dict) -> base_pb2.Node:
    node = base_pb2.Node(id=node_id)
    json_format.ParseDict(metadata, node.metadata)
    return node


def _generic(
    tu: str, name: str, resource: any_pb2.Any, ts: TypeSync, current: str, exclude: bool
) -> csds_pb2.ClientConfig.GenericXdsConfig:
    g = csds_pb2.ClientConfig.GenericXdsConfig(type_url=tu, name=name)
    if ts.nack_version and ts.nack_version != ts.acked_version:
        g.config_status, g.client_status = ConfigStatus.ERROR, cd.NACKED
        g.version_info = ts.nack_version
        g.error_state.details = ts.nack_error
        g.error_state.version_info = ts.nack_version
        g.error_state.last_update_attempt.CopyFrom(_timestamp(ts.nack_at))
    elif ts.sent_version != current:
        g.config_status = ConfigStatus.NOT_SENT
        g.client_status = cd.ACKED if ts.acked_version else cd.REQUESTED
        g.version_info = ts.acked_version or ts.sent_version
    elif ts.acked_version == ts.sent_version:
        g.config_status, g.client_status = ConfigStatus.SYNCED, cd.ACKED
        g.version_info = ts.acked_version
    else:
        g.config_status, g.client_status = ConfigStatus.STALE, cd.REQUESTED
        g.version_info = ts.sent_version
    g.last_updated.CopyFrom(_timestamp(ts.acked_at or ts.sent_at))
    if not exclude:
        g.xds_config.CopyFrom(_redacted(resource))
    return g


def _redacted(resource: any_pb2.Any) -> any_pb2.Any:
    """The resource with plaintext credentials (native authz mode) replaced, as the admin
    API's config dump shows them: CSDS is readable by any holder of a mesh certificate."""
    doc = json_format.MessageToDict(resource)
    clean = redact(doc)
    if clean == doc:
        return resource
    return json_format.ParseDict(clean, any_pb2.Any())


def redact(doc: Any) -> Any:
    """A config-dump dict with plaintext credentials replaced by "[redacted]"."""
    if isinstance(doc, list):
        return [redact(x) for x in doc]
    if not isinstance(doc, dict):
        return doc
    out = {k: redact(v) for k, v in doc.items()}
    field = _SECRET_FIELDS.get(str(doc.get("@type", "")).rsplit(".", 1)[-1])
    if field and isinstance(out.get(field), list):
        out[field] = [{**c, "key": "[redacted]"} for c in out[field] if isinstance(c, dict)]
    return out


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def _matcher(i: int, m: node_pb2.NodeMatcher) -> Callable[[str], bool]:
    """A predicate on node ids from a NodeMatcher: node_id by exact, prefix, suffix, contains
    or safe_regex; node_metadatas are not supported (BadRequest naming the field)."""
    where = f"node_matchers[{i}]"
    if m.node_metadatas:
        raise BadRequest(f"{where}.node_metadatas: not supported; match on node_id")
    if not m.HasField("node_id"):
        return lambda _node_id: True
    s = m.node_id
    kind = s.WhichOneof("match_pattern")
    value = getattr(s, kind) if kind else None
    if s.ignore_case and kind != "safe_regex":
        value = value.lower()

    def fold(node_id: str) -> str:
        return node_id.lower() if s.ignore_case else node_id

    if kind == "exact":
        return lambda node_id: fold(node_id) == value
    if kind == "prefix":
        return lambda node_id: fold(node_id).startswith(value)
    if kind == "suffix":
        return lambda node_id: fold(node_id).endswith(value)
    if kind == "contains":
        return lambda node_id: value in fold(node_id)
    if kind == "safe_regex":
        return _regex(f"{where}.node_id.safe_regex.regex", value.regex)
    raise BadRequest(f"{where}.node_id: no match pattern set")


def _regex(where: str, regex: str) -> Callable[[str], bool]:
    """RE2, as Envoy's safe_regex is: linear in the node id, whatever the pattern."""
    try:
        pattern = re2.compile(regex, _RE2_OPTIONS)
    except re2.error as e:
        why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else e
        raise BadRequest(f"{where}: not an RE2 regex: {why}") from None
    if pattern.programsize > MAX_REGEX_PROGRAM_SIZE:
        raise BadRequest(
            f"{where}: program size {pattern.programsize} is over the limit of "
            f"{MAX_REGEX_PROGRAM_SIZE}"
        )
    return lambda node_id: pattern.fullmatch(node_id) is not None


def add_to_server(server: grpc.aio.Server, servicer: CsdsServicer) -> None:
    csds_pb2_grpc.add_ClientStatusDiscoveryServiceServicer_to_server(servicer, server)

"""Who a sidecar is, read from its node metadata (set by `sidecar.bootstrap.ads_bootstrap`)."""

from __future__ import annotations

import dataclasses
import functools
import re
import weakref
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from mesh_common.node_metadata import (
    HOST,
    INBOUND_PORT,
    LISTEN_HOST,
    LOCAL_ENDPOINT,
    LOCAL_HTTP_ENDPOINT,
    OUTBOUND_PORT,
    SERVICE,
    VERSION,
)

_INTERNED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_ZONE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,62}\Z")


@dataclass(frozen=True)
class NodeInfo:
    """Everything a snapshot depends on; sidecars with equal NodeInfo share one snapshot."""

    service: str | None = None
    version: str | None = None
    inbound_port: int | None = None
    outbound_port: int | None = None
    local_endpoint: str | None = None  # host:port of the runtime an inbound listener fronts
    # host:port of that runtime's OpenAI HTTP API (`meshlm serve --http-port`)
    local_http_endpoint: str | None = None
    listen_host: str = "127.0.0.1"
    # ip:port callers reach the inbound listener at, when it is not listen_host:inbound_port
    host: str | None = None
    # Envoy's Node.locality.zone: the caller's zone, which orders its EDS priorities. Sidecars
    # of one zone share a snapshot, so snapshots scale with zones, not nodes.
    zone: str | None = None

    def __hash__(self) -> int:
        # Every ACK looks up its group's expected generations: hash the fields once.
        return self._hash

    @functools.cached_property
    def _fields(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @functools.cached_property
    def _hash(self) -> int:
        return hash(self._fields)

    def interned(self) -> NodeInfo:
        """The one live instance equal to this: thousands of sidecars of a group then look up
        its snapshot by identity, not by comparing every field. Keyed by the field values, not
        the instance, so an entry goes when its last user does."""
        return _INTERNED.setdefault(self._fields, self)

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> NodeInfo:
        """Raises ValueError naming the metadata key for a value of the wrong kind."""

        def port(key: str) -> int | None:
            v = md.get(key)
            if v in (None, ""):
                return None
            try:
                p = int(v)
            except (TypeError, ValueError):
                p = -1
            if isinstance(v, bool) or (p != v and str(p) != v) or not 0 < p < 65536:
                raise ValueError(f"node.metadata[{key!r}]: not a port: {v!r}"[:200])
            return p

        def text(key: str) -> str | None:
            v = md.get(key)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"node.metadata[{key!r}]: not a string: {v!r}"[:200])
            return v or None

        return cls(
            service=text(SERVICE),
            version=text(VERSION),
            inbound_port=port(INBOUND_PORT),
            outbound_port=port(OUTBOUND_PORT),
            local_endpoint=text(LOCAL_ENDPOINT),
            local_http_endpoint=text(LOCAL_HTTP_ENDPOINT),
            listen_host=text(LISTEN_HOST) or "127.0.0.1",
            host=text(HOST),
        )

    @property
    def inbound_endpoint(self) -> str:
        """The `ip:port` of this sidecar's inbound listener as callers reach it."""
        return self.host or f"{self.listen_host}:{self.inbound_port}"

    @classmethod
    def from_node(cls, node: Any) -> NodeInfo:  # envoy.config.core.v3.Node
        return cls.from_metadata(json_format.MessageToDict(node.metadata)).with_locality(node)

    def with_locality(self, node: Any) -> NodeInfo:
        """This NodeInfo with the zone of `node.locality`; ValueError for a malformed one."""
        zone = node.locality.zone if node.HasField("locality") else ""
        if not zone or self.outbound_port is None:  # only a caller's clusters depend on it
            return self
        if not _ZONE.match(zone):
            raise ValueError(f"node.locality.zone: not a zone name: {zone[:64]!r}")
        return dataclasses.replace(self, zone=zone)

    def label(self) -> str:
        parts = []
        if self.inbound_port is not None:
            parts.append(f"inbound {self.service}/{self.version}:{self.inbound_port}")
        if self.outbound_port is not None:
            parts.append(f"outbound :{self.outbound_port}")
            if self.zone:
                parts.append(f"zone {self.zone}")
        return ", ".join(parts) or "no listeners"

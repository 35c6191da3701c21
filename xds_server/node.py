"""Who a sidecar is, read from its node metadata (set by `sidecar.bootstrap.ads_bootstrap`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

SERVICE = "meshlm.service"
VERSION = "meshlm.version"
INBOUND_PORT = "meshlm.inbound_port"
OUTBOUND_PORT = "meshlm.outbound_port"
LOCAL_ENDPOINT = "meshlm.local_endpoint"
LISTEN_HOST = "meshlm.listen_host"


@dataclass(frozen=True)
class NodeInfo:
    """Everything a snapshot depends on; sidecars with equal NodeInfo share one snapshot."""

    service: str | None = None
    version: str | None = None
    inbound_port: int | None = None
    outbound_port: int | None = None
    local_endpoint: str | None = None  # host:port of the runtime an inbound listener fronts
    listen_host: str = "127.0.0.1"

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> NodeInfo:
        def port(key: str) -> int | None:
            v = md.get(key)
            return None if v in (None, "") else int(v)

        return cls(
            service=md.get(SERVICE) or None,
            version=md.get(VERSION) or None,
            inbound_port=port(INBOUND_PORT),
            outbound_port=port(OUTBOUND_PORT),
            local_endpoint=md.get(LOCAL_ENDPOINT) or None,
            listen_host=md.get(LISTEN_HOST) or "127.0.0.1",
        )

    @classmethod
    def from_node(cls, node: Any) -> NodeInfo:  # envoy.config.core.v3.Node
        return cls.from_metadata(json_format.MessageToDict(node.metadata))

    def label(self) -> str:
        parts = []
        if self.inbound_port is not None:
            parts.append(f"inbound {self.service}/{self.version}:{self.inbound_port}")
        if self.outbound_port is not None:
            parts.append(f"outbound :{self.outbound_port}")
        return ", ".join(parts) or "no listeners"

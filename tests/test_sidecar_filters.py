"""What each sidecar listener runs per call (issue 19, item 3): only what something reads. The
rollout gates and the SLO loop read grpc_stats on caller sidecars
(xds_server/rollout/gates/envoy_stats.py), so the inbound listener goes without it; nothing reads
its filter state."""

from __future__ import annotations

from envoy.extensions.filters.http.grpc_stats.v3 import config_pb2 as grpc_stats_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)

from mesh_common import type_urls as t
from wasm_filters.policy import hash_key
from xds_server.mesh import parse_mesh
from xds_server.resources.build import build_resources
from xds_server.resources.faults import FILTER_NAME as FAULT_FILTER
from xds_server.resources.names import AUTHZ_FILTER
from xds_server.xds.node import NodeInfo

GRPC_STATS = "envoy.filters.http.grpc_stats"
ROUTER = "envoy.filters.http.router"
MESH = parse_mesh(
    {
        "services": {"llm": {"versions": {"v1": {"endpoints": ["127.0.0.1:1"]}}}},
        "tenants": {"a": {"key_sha256": hash_key("k"), "allow": ["llm/*"]}},
    }
)


def _filters(node: NodeInfo) -> list[hcm_pb2.HttpFilter]:
    (listener,) = build_resources(MESH, node)[t.LISTENER].values()
    hcm = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return list(hcm.http_filters)


def test_inbound_listener_runs_authz_then_a_host_fault_and_the_router_only() -> None:
    node = NodeInfo(service="llm", version="v1", inbound_port=1)
    assert [f.name for f in _filters(node)] == [AUTHZ_FILTER, FAULT_FILTER, ROUTER]


def test_caller_listener_counts_grpc_status_per_method_without_filter_state() -> None:
    first = _filters(NodeInfo(outbound_port=1))[0]
    assert first.name == GRPC_STATS
    cfg = grpc_stats_pb2.FilterConfig()
    first.typed_config.Unpack(cfg)
    assert cfg.stats_for_all_methods.value and not cfg.emit_filter_state

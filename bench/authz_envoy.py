"""The static Envoy that `python -m bench authz` drives: one listener running the HTTP filters of
a mode, then either a direct response (so the figures are Envoy and its filters, not an
upstream) or routes to an upstream (gRPC over HTTP/2, anything else over HTTP/1.1)."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from mesh_common.ports import free_port
from sidecar.bootstrap import static_cluster

HCM = (
    "type.googleapis.com/envoy.extensions.filters.network."
    "http_connection_manager.v3.HttpConnectionManager"
)
ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}


def bootstrap(
    http_filters: list[Any], *, grpc_port: int, http_port: int, direct_response: bool
) -> dict[str, Any]:
    """Static bootstrap: listener -> `http_filters` (protos or dicts) + router -> upstreams, or
    a direct response."""
    filters = [
        f if isinstance(f, dict) else json_format.MessageToDict(f, preserving_proto_field_name=True)
        for f in http_filters
    ]

    def cluster(name: str, upstream_port: int, h2: bool) -> dict[str, Any]:
        return static_cluster(name, "127.0.0.1", upstream_port, http2=h2, connect_timeout="2s")

    grpc_match = {"name": "content-type", "string_match": {"prefix": "application/grpc"}}
    routes: list[dict[str, Any]] = [
        {"match": {"prefix": "/", "headers": [grpc_match]}, "route": {"cluster": "grpc_upstream"}},
        {"match": {"prefix": "/"}, "route": {"cluster": "http_upstream"}},
    ]
    if direct_response:
        ok = {"status": 200, "body": {"inline_string": "ok"}}
        routes = [{"match": {"prefix": "/"}, "direct_response": ok}]
    hcm = {
        "@type": HCM,
        "stat_prefix": "inbound",
        "codec_type": "AUTO",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
        "http_filters": [*filters, ROUTER],
    }
    hcm_filter = {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
    listener = {
        "name": "inbound",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": free_port()}},
        "filter_chains": [{"filters": [hcm_filter]}],
    }
    return {
        "node": {"id": "authz-testbed", "cluster": "authz-testbed"},
        "static_resources": {
            "listeners": [listener],
            "clusters": [
                cluster("grpc_upstream", grpc_port, True),
                cluster("http_upstream", http_port, False),
            ],
        },
    }


def listener_port(boot: dict[str, Any]) -> int:
    return boot["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]

"""The inbound sidecar's config, part by part, as static Envoy bootstraps (issue 19, item 3).

The listener, route, cluster and authz filter come from the control plane's own builders
(`xds_server.resources.build_resources`), so the measurement follows the config the control
plane really pushes. What ADS would deliver is put inline (RDS -> `route_config`, ECDS ->
`typed_config`, EDS -> a STATIC cluster); then parts are taken out:

- `bare`: the same listener and HCM settings with the router alone, a route `/` -> the cluster,
  a cluster of one host (HTTP/2, the connect timeout): a bare Envoy hop;
- each part of PARTS put back alone on top of `bare` (the rate limit only with authz: it reads
  the tenant header the authz filter sets, and asks nothing without it; it is in the config only
  with `rate_limits: {mode: global}`);
- every part: the full inbound config.

Also an upstream that can take the load: an Envoy that answers every call with an empty gRPC
OK stream (trailers-only: `grpc-status: 0` in the headers).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import base_pb2, extension_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    header_mutation_pb2 as early_pb2,
)
from google.protobuf import json_format

from mesh_common import type_urls as t
from mesh_common.ports import free_port
from sidecar.bootstrap import XDS_CLUSTER, static_cluster
from xds_server import mesh as m
from xds_server.resources import faults, listeners
from xds_server.resources.build import build_resources
from xds_server.resources.names import AUTHZ_FILTER
from xds_server.xds.node import NodeInfo

# part -> what it is in the inbound config
PARTS = {
    "access_log": "JSON access log (stdout) of failed calls: a filter on every call",
    "authz": "Wasm authz filter (V8), with the tenant's share of its rate limit",
    "ratelimit": "global rate limit filter (asks the control plane's RLS on every call)",
    "fault": "HTTP fault filter (injects nothing unless a host fault names this host)",
    "strip_headers": "early header mutation (strips client-sent identity headers)",
    "local_reply": "local reply mapper (UC -> HTTP 500)",
    "route": "the real route (ORCA route, max_stream_duration, hash policy)",
    "cluster": "the real cluster (outlier detection, circuit breakers, lb policy)",
}
ROUTER = "envoy.filters.http.router"
_FILTER_PART = {
    AUTHZ_FILTER: "authz",
    "envoy.filters.http.ratelimit": "ratelimit",
    faults.FILTER_NAME: "fault",
}


def inbound_resources(mesh: m.Mesh, service: str, version: str, local: int) -> dict[str, Any]:
    """What the control plane pushes to the inbound sidecar of `service`/`version` that fronts
    127.0.0.1:`local`, on a fresh port."""
    node = NodeInfo(
        service=service,
        version=version,
        inbound_port=free_port(),
        local_endpoint=f"127.0.0.1:{local}",
    )
    return build_resources(mesh, node)


def _one(res: dict[str, Any], type_url: str) -> Any:
    (msg,) = res[type_url].values()
    return msg


def hcm_of(listener: Any) -> hcm_pb2.HttpConnectionManager:
    hcm = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return hcm


def listener_port(res: dict[str, Any]) -> int:
    return _one(res, t.LISTENER).address.socket_address.port_value


def bootstrap(res: dict[str, Any], parts: Iterable[str], *, xds_port: int) -> dict[str, Any]:
    """A static bootstrap of the inbound listener in `res` with only `parts` of PARTS on;
    `xds_port` is the control plane (the rate limit filter's RLS)."""
    on = set(parts)
    unknown = on - set(PARTS)
    if unknown:
        raise ValueError(f"parts: unknown {sorted(unknown)}; known: {sorted(PARTS)}")
    listener = _one(res, t.LISTENER)
    listener_out = type(listener)()
    listener_out.CopyFrom(listener)
    hcm = hcm_of(listener)
    filters = []
    for f in hcm.http_filters:
        part = _FILTER_PART.get(f.name)
        if part is None and f.name != ROUTER:
            # A new filter in the inbound config must become a part, or `bare` is not bare.
            raise ValueError(f"inbound listener: filter {f.name} is not one of the parts")
        if part is not None and part not in on:
            continue
        if f.HasField("config_discovery"):  # ECDS: inline what the control plane would send
            inline = hcm_pb2.HttpFilter(name=f.name)
            inline.typed_config.CopyFrom(res[t.EXTENSION_CONFIG][f.name].typed_config)
            f = inline
        filters.append(f)
    del hcm.http_filters[:]
    hcm.http_filters.extend(filters)
    if "access_log" not in on:
        del hcm.access_log[:]
    if "strip_headers" not in on:
        del hcm.early_header_mutation_extensions[:]
    if "local_reply" not in on:
        hcm.ClearField("local_reply_config")
    # The calls' cluster: an inbound sidecar also has the ORCA streams' twin ("...|orca"),
    # which only the real route names.
    (calls,) = (n for n in res[t.CLUSTER] if not n.endswith("|orca"))
    route = _one(res, t.ROUTE) if "route" in on else _bare_route(calls)
    hcm.ClearField("rds")
    hcm.route_config.CopyFrom(route)
    listener_out.filter_chains[0].filters[0].typed_config.Pack(hcm)
    wanted = res[t.CLUSTER] if "route" in on else {calls: res[t.CLUSTER][calls]}
    return {
        "node": {"id": "sidecar-parts", "cluster": "meshlm"},
        "static_resources": {
            "listeners": [_json(listener_out)],
            "clusters": [
                *(
                    _static(c, res[t.ENDPOINT][name], real="cluster" in on)
                    for name, c in wanted.items()
                ),
                static_cluster(XDS_CLUSTER, "127.0.0.1", xds_port),
            ],
        },
    }


def _bare_route(cluster: str) -> route_pb2.RouteConfiguration:
    route = rc.Route(match=rc.RouteMatch(prefix="/"), route=rc.RouteAction(cluster=cluster))
    return route_pb2.RouteConfiguration(
        name="bare", virtual_hosts=[rc.VirtualHost(name="bare", domains=["*"], routes=[route])]
    )


def _static(cluster: Any, endpoints: Any, *, real: bool) -> dict[str, Any]:
    """The EDS cluster as a STATIC one with its endpoints inline; not `real`: only its name,
    connect timeout and HTTP/2 options."""
    c = cluster_pb2.Cluster()
    if real:
        c.CopyFrom(cluster)
        c.ClearField("eds_cluster_config")
    else:
        c.name = cluster.name
        c.connect_timeout.CopyFrom(cluster.connect_timeout)
        for k, v in cluster.typed_extension_protocol_options.items():
            c.typed_extension_protocol_options[k].CopyFrom(v)
    c.type = cluster_pb2.Cluster.STATIC
    c.load_assignment.CopyFrom(endpoints)
    return _json(c)


def _set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, value=value),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _json(msg: Any) -> dict[str, Any]:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def grpc_ok_upstream(port: int) -> dict[str, Any]:
    """Bootstrap of an Envoy on `port` that answers every call with an empty gRPC OK stream.
    Envoy turns a direct response to a gRPC request into a gRPC error (its status from the
    HTTP code), so the request's content-type is renamed before routing (early header
    mutation) and the reply states the gRPC content-type and status itself."""
    lst = listeners.http_listener(
        "grpc_ok",
        host="127.0.0.1",
        port=port,
        route_config_name="unused",
        stat_prefix="upstream",
        stream_idle_timeout=60,
    )
    hcm = hcm_of(lst)
    del hcm.http_filters[:-1]  # the router only
    hcm.ClearField("rds")
    ok = rc.Route(
        match=rc.RouteMatch(prefix="/"),
        direct_response=rc.DirectResponseAction(status=200),
    )
    for k, v in (("content-type", "application/grpc"), ("grpc-status", "0")):
        ok.response_headers_to_add.append(_set_header(k, v))
    hcm.route_config.CopyFrom(
        route_pb2.RouteConfiguration(
            name="grpc_ok", virtual_hosts=[rc.VirtualHost(name="ok", domains=["*"], routes=[ok])]
        )
    )
    rename = mutation_rules_pb2.HeaderMutation(append=_set_header("content-type", "x-bench"))
    ext = extension_pb2.TypedExtensionConfig(
        name="envoy.http.early_header_mutation.header_mutation"
    )
    ext.typed_config.Pack(early_pb2.HeaderMutation(mutations=[rename]))
    hcm.early_header_mutation_extensions.append(ext)
    lst.filter_chains[0].filters[0].typed_config.Pack(hcm)
    return {
        "node": {"id": "grpc-ok-upstream", "cluster": "bench"},
        "static_resources": {"listeners": [_json(lst)]},
    }

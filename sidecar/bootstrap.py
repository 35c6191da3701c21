"""The bootstrap of a sidecar that takes all of its configuration from the control plane (ADS).

Only the way to the control plane is static; listeners, routes, clusters and the authz filter
come over ADS. The node metadata says who this sidecar is, which decides what it is sent.
"""

from __future__ import annotations

from typing import Any

from mesh_common import budget_wire, node_metadata
from mesh_common.sds_names import DEFAULT, ROOTCA, SDS_CLUSTER
from sidecar.sds import secret_ref

XDS_CLUSTER = "xds_cluster"
_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_UPSTREAM_TLS = "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
# The control plane's service account (xds_server/identity/ca.py CONTROL_PLANE_SA; istiod's in
# Istio).
CONTROL_PLANE_SA = "meshlm-system/control-plane"


def ads_bootstrap(
    node_id: str,
    *,
    xds_address: tuple[str, int] | list[tuple[str, int]],
    service: str | None = None,
    version: str | None = None,
    inbound_port: int | None = None,
    outbound_port: int | None = None,
    local_endpoint: str | None = None,
    local_http_endpoint: str | None = None,
    listen_host: str | None = None,
    host: str | None = None,
    api_type: str = "GRPC",
    admin_port: int = 0,
    cluster: str = "meshlm",
    zone: str | None = None,
    budget_port: int | None = None,
) -> dict[str, Any]:
    """A bootstrap dict for `sidecar.envoy_process.EnvoyProcess`.

    `api_type` is "GRPC" (state of the world) or "DELTA_GRPC" (incremental). `local_endpoint`
    ("host:port") is the runtime an inbound listener fronts; without it the control plane uses
    the endpoints the mesh file lists for this service version; `local_http_endpoint` that
    runtime's OpenAI HTTP API (`meshlm serve --http-port`), routed on /v1/. `xds_address` may
    list every control-plane replica: the xds cluster then has one endpoint each,
    and when the stream's replica dies Envoy's reconnect goes to one that answers.
    `listen_host`: the IP address the sidecar's listeners bind (default 127.0.0.1; a pod's
    sidecar that other pods call binds 0.0.0.0). `host`: the `ip:port` callers reach the inbound
    listener at, where that is not `listen_host:inbound_port` (the address a sidecar on 0.0.0.0
    registers): the host a mesh fault's `host:` names. `zone`: the node's locality zone, which
    orders the zones of its callee clusters (a service's `locality`). `budget_port`: a loopback
    listener where the local runtime reaches the control plane's token budget service
    (`meshlm serve --budget-service`), forwarded over this sidecar's way to the control plane.
    """
    if api_type not in ("GRPC", "DELTA_GRPC"):
        raise ValueError(f"api_type: expected GRPC or DELTA_GRPC, got {api_type!r}")
    if inbound_port is not None and not (service and version):
        raise ValueError("inbound_port needs service and version (the runtime it fronts)")
    metadata: dict[str, Any] = {}
    for key, value in (
        (node_metadata.SERVICE, service),
        (node_metadata.VERSION, version),
        (node_metadata.INBOUND_PORT, inbound_port),
        (node_metadata.OUTBOUND_PORT, outbound_port),
        (node_metadata.LOCAL_ENDPOINT, local_endpoint),
        (node_metadata.LOCAL_HTTP_ENDPOINT, local_http_endpoint),
        (node_metadata.LISTEN_HOST, listen_host),
        (node_metadata.HOST, host),
    ):
        if value is not None:
            metadata[key] = value
    addresses = [xds_address] if isinstance(xds_address, tuple) else list(xds_address)
    if not addresses:
        raise ValueError("xds_address: at least one control plane HOST:PORT")
    ads = {"ads": {}, "resource_api_version": "V3"}
    node: dict[str, Any] = {"id": node_id, "cluster": cluster, "metadata": metadata}
    if zone:
        node["locality"] = {"zone": zone}
    return {
        "node": node,
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "dynamic_resources": {
            "ads_config": {
                "api_type": api_type,
                "transport_api_version": "V3",
                "grpc_services": [
                    {
                        "envoy_grpc": {
                            "cluster_name": XDS_CLUSTER,
                            # Reconnect fast after a control-plane restart (default max 30 s).
                            "retry_policy": {
                                "retry_back_off": {"base_interval": "0.1s", "max_interval": "2s"}
                            },
                        }
                    }
                ],
                # Envoy >= 1.22: ADS on one stream with ordered pushes.
                "set_node_on_first_message_only": True,
            },
            "lds_config": ads,
            "cds_config": ads,
        },
        "static_resources": {
            "clusters": [xds_cluster(addresses)],
            "listeners": [] if budget_port is None else [budget_listener(budget_port)],
        },
    }


BUDGET_LISTENER = "budget"
_HCM = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "envoy.extensions.filters.http.router.v3.Router"


def budget_listener(port: int) -> dict[str, Any]:
    """Loopback only, and only the token budget service's methods: the runtime's way to the
    control plane, as this sidecar (its workload certificate where the mesh has identity)."""
    route = {
        "match": {"prefix": budget_wire.PATH_PREFIX},
        "route": {"cluster": XDS_CLUSTER, "timeout": "5s"},
    }
    refuse = {"match": {"prefix": "/"}, "direct_response": {"status": 404}}
    hcm = {
        "@type": "type.googleapis.com/" + _HCM,
        "stat_prefix": "budget",
        "codec_type": "HTTP2",
        "route_config": {
            "virtual_hosts": [{"name": "budget", "domains": ["*"], "routes": [route, refuse]}]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/" + _ROUTER},
            }
        ],
    }
    return {
        "name": BUDGET_LISTENER,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }


def xds_cluster(addresses: list[tuple[str, int]]) -> dict[str, Any]:
    """The static cluster of the control plane's replicas. A replica that refuses or drops
    connections is ejected for a while (outlier detection on local origin errors), so the next
    reconnect picks a live one instead of trying the dead one every other time."""
    cluster = static_cluster(XDS_CLUSTER, *addresses[0])
    if len(addresses) > 1:
        cluster["load_assignment"]["endpoints"] = [
            {"lb_endpoints": [_lb_endpoint(h, p) for h, p in addresses]}
        ]
        cluster["outlier_detection"] = {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "interval": "1s",
            "base_ejection_time": "5s",
            "max_ejection_percent": 100,
        }
    return cluster


def _lb_endpoint(host: str, port: int) -> dict[str, Any]:
    return {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}


def with_sds(boot: dict[str, Any], socket_path: str) -> dict[str, Any]:
    """`boot` with the static cluster by which Envoy reads its certificates (SDS) from the
    sidecar's identity agent on the unix socket `socket_path` (sidecar/sds.py)."""
    clusters = boot.setdefault("static_resources", {}).setdefault("clusters", [])
    clusters[:] = [c for c in clusters if c.get("name") != SDS_CLUSTER]
    clusters.append(static_cluster(SDS_CLUSTER, pipe=socket_path))
    return boot


def control_plane_id(workload_id: str) -> str:
    """The control plane's SPIFFE ID in the trust domain of `workload_id` (this sidecar's)."""
    trust_domain = workload_id.removeprefix("spiffe://").split("/", 1)[0]
    ns, sa = CONTROL_PLANE_SA.split("/")
    return f"spiffe://{trust_domain}/ns/{ns}/sa/{sa}"


def with_ads_tls(boot: dict[str, Any], peer_id: str) -> dict[str, Any]:
    """`boot` with its way to the control plane over mTLS: this workload's certificate
    (SDS `default`), the mesh's roots (`ROOTCA`) and `peer_id` as the only SPIFFE ID taken from
    the server. ADS, the global rate limit and the access log service all ride `xds_cluster`."""
    for cluster in boot.get("static_resources", {}).get("clusters", []):
        if cluster.get("name") == XDS_CLUSTER:
            cluster["transport_socket"] = {
                "name": "envoy.transport_sockets.tls",
                "typed_config": {
                    "@type": "type.googleapis.com/" + _UPSTREAM_TLS,
                    "common_tls_context": {
                        # Envoy's upstream default is at most 1.2; the mesh's hops are 1.3.
                        "tls_params": {
                            "tls_minimum_protocol_version": "TLSv1_3",
                            "tls_maximum_protocol_version": "TLSv1_3",
                        },
                        "alpn_protocols": ["h2"],
                        "tls_certificate_sds_secret_configs": [secret_ref(DEFAULT)],
                        "combined_validation_context": {
                            "default_validation_context": {
                                "match_typed_subject_alt_names": [
                                    {"san_type": "URI", "matcher": {"exact": peer_id}}
                                ]
                            },
                            "validation_context_sds_secret_config": secret_ref(ROOTCA),
                        },
                    },
                },
            }
    return boot


def static_cluster(
    name: str,
    host: str = "",
    port: int = 0,
    *,
    http2: bool = True,
    connect_timeout: str = "1s",
    pipe: str | None = None,
) -> dict[str, Any]:
    """A STATIC cluster of one endpoint (`host:port`, or the unix socket `pipe`), HTTP/2
    upstream (gRPC) unless `http2` is False."""
    if pipe:
        address: dict[str, Any] = {"pipe": {"path": pipe}}
    else:
        address = {"socket_address": {"address": host, "port_value": port}}
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": connect_timeout,
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            _HTTP_OPTIONS: {
                "@type": "type.googleapis.com/" + _HTTP_OPTIONS,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster

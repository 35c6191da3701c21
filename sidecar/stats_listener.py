"""A read-only window on Envoy's admin for other hosts: a static listener that passes GET
/stats (and /stats/prometheus) to the admin and answers 404 to anything else.

The admin itself stays on loopback: it can also stop Envoy, drain its listeners or change its
log level, which no other host may. A control plane on another host reads a caller sidecar's
counters (the rollout gates' `caller_sidecars[].admin_url`) through this listener instead.
"""

from __future__ import annotations

from typing import Any

from sidecar.bootstrap import static_cluster

STATS_LISTENER = "meshlm_stats"
STATS_CLUSTER = "meshlm_admin"
_HCM = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "envoy.extensions.filters.http.router.v3.Router"


def with_stats_listener(
    bootstrap: dict[str, Any], *, host: str, port: int, admin_port: int
) -> dict[str, Any]:
    """Add the stats listener on `host:port` to `bootstrap`, its upstream the admin on
    127.0.0.1:`admin_port`."""
    get_only = [{"name": ":method", "string_match": {"exact": "GET"}}]
    routes = [
        {"match": {"path": "/stats", "headers": get_only}, "route": {"cluster": STATS_CLUSTER}},
        {
            "match": {"path": "/stats/prometheus", "headers": get_only},
            "route": {"cluster": STATS_CLUSTER},
        },
        {"match": {"prefix": "/"}, "direct_response": {"status": 404}},
    ]
    hcm = {
        "@type": "type.googleapis.com/" + _HCM,
        "stat_prefix": STATS_LISTENER,
        "route_config": {
            "name": STATS_LISTENER,
            "virtual_hosts": [{"name": "stats", "domains": ["*"], "routes": routes}],
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/" + _ROUTER},
            }
        ],
    }
    listener = {
        "name": STATS_LISTENER,
        "address": {"socket_address": {"address": host, "port_value": port}},
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }
    static = bootstrap.setdefault("static_resources", {})
    static.setdefault("listeners", []).append(listener)
    admin = static_cluster(STATS_CLUSTER, "127.0.0.1", admin_port, http2=False)
    static.setdefault("clusters", []).append(admin)
    return bootstrap

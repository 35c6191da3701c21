"""ClusterLoadAssignment: the hosts of one cluster."""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2 as ec
from envoy.config.endpoint.v3 import endpoint_pb2
from google.protobuf import wrappers_pb2

from xds_server import mesh as m
from xds_server.resources.common import socket_address

_HEALTHY = health_check_pb2.HealthStatus.HEALTHY
_UNHEALTHY = health_check_pb2.HealthStatus.UNHEALTHY


def load_assignment(
    cluster_name: str,
    endpoints: Iterable[m.Endpoint],
    registered: Iterable[m.RegisteredEndpoint] = (),
) -> endpoint_pb2.ClusterLoadAssignment:
    """The mesh file's `endpoints` (health unknown: Envoy's own checks decide), then the
    registered hosts by zone (a locality each), with the health their sidecars report."""
    static = list(endpoints)
    by_zone: dict[str, list[ec.LbEndpoint]] = {
        "": [
            ec.LbEndpoint(endpoint=ec.Endpoint(address=socket_address(e.host, e.port)))
            for e in static
        ]
    }
    for r in registered:
        if r.endpoint in static:  # the file names it too: one host, listed once
            continue
        host = ec.LbEndpoint(
            endpoint=ec.Endpoint(address=socket_address(r.endpoint.host, r.endpoint.port)),
            health_status=_HEALTHY if r.healthy else _UNHEALTHY,
        )
        if r.weight is not None:
            host.load_balancing_weight.CopyFrom(wrappers_pb2.UInt32Value(value=r.weight))
        by_zone.setdefault(r.zone or "", []).append(host)
    localities = [
        ec.LocalityLbEndpoints(
            locality=base_pb2.Locality(zone=zone) if zone else None, lb_endpoints=hosts
        )
        for zone, hosts in sorted(by_zone.items())
    ]
    return endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster_name, endpoints=localities)

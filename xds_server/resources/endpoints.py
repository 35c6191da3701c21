"""ClusterLoadAssignment: the hosts of one cluster."""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2 as ec
from envoy.config.endpoint.v3 import endpoint_pb2
from google.protobuf import wrappers_pb2

from xds_server import mesh as m
from xds_server.mesh.locality import Locality, priorities
from xds_server.resources.common import socket_address

_HEALTHY = health_check_pb2.HealthStatus.HEALTHY
_UNHEALTHY = health_check_pb2.HealthStatus.UNHEALTHY


def load_assignment(
    cluster_name: str,
    endpoints: Iterable[m.Endpoint],
    registered: Iterable[m.RegisteredEndpoint] = (),
    *,
    caller_zone: str | None = None,
    locality: Locality | None = None,
) -> endpoint_pb2.ClusterLoadAssignment:
    """The mesh file's `endpoints` (health unknown: Envoy's own checks decide) and the
    registered hosts, by zone (a locality each), with the health their sidecars report. With a
    service `locality` and a caller in a zone, each zone gets the priority it has for that
    caller (own zone 0, then failover order): Envoy keeps calls at priority 0 while it is
    healthy enough (overprovisioning factor 1.4: below about 72 % healthy hosts the surplus
    spills to the next priority) and moves them back as its hosts recover."""
    static = list(endpoints)
    by_zone: dict[str, list[ec.LbEndpoint]] = {"": []}
    for e in static:
        by_zone.setdefault(e.zone or "", []).append(
            ec.LbEndpoint(endpoint=ec.Endpoint(address=socket_address(e.host, e.port)))
        )
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
    rank = priorities(set(by_zone), caller_zone, locality)
    localities = [
        ec.LocalityLbEndpoints(
            locality=base_pb2.Locality(zone=zone) if zone else None,
            lb_endpoints=hosts,
            priority=rank[zone],
        )
        for zone, hosts in sorted(by_zone.items(), key=lambda zh: (rank[zh[0]], zh[0]))
    ]
    return endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster_name, endpoints=localities)

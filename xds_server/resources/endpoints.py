"""ClusterLoadAssignment: the hosts of one cluster."""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.endpoint.v3 import endpoint_components_pb2 as ec
from envoy.config.endpoint.v3 import endpoint_pb2

from xds_server import mesh as m
from xds_server.resources.common import socket_address


def load_assignment(
    cluster_name: str, endpoints: Iterable[m.Endpoint]
) -> endpoint_pb2.ClusterLoadAssignment:
    lb = [
        ec.LbEndpoint(endpoint=ec.Endpoint(address=socket_address(e.host, e.port)))
        for e in endpoints
    ]
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=cluster_name, endpoints=[ec.LocalityLbEndpoints(lb_endpoints=lb)]
    )

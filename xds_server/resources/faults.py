"""Envoy's HTTP fault filter on the caller sidecars: the listener holds it with no fault; a
service's virtual host turns its mesh fault on (typed_per_filter_config, pushed by RDS)."""

from __future__ import annotations

from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.extensions.filters.common.fault.v3 import fault_pb2 as common_fault
from envoy.extensions.filters.http.fault.v3 import fault_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.type.matcher.v3 import string_pb2
from envoy.type.v3 import percent_pb2

from xds_server.mesh.faults import Fault
from xds_server.resources import names
from xds_server.resources.common import duration, pack

FILTER_NAME = "envoy.filters.http.fault"


def fault_filter() -> hcm_pb2.HttpFilter:
    """The listener's fault filter: injects nothing until a route's config names a fault."""
    return hcm_pb2.HttpFilter(name=FILTER_NAME, typed_config=pack(fault_pb2.HTTPFault()))


def _percent(value: float) -> percent_pb2.FractionalPercent:
    return percent_pb2.FractionalPercent(
        numerator=round(value * 10_000), denominator=percent_pb2.FractionalPercent.MILLION
    )


def http_fault(fault: Fault) -> fault_pb2.HTTPFault:
    out = fault_pb2.HTTPFault()
    if fault.delay is not None:
        out.delay.CopyFrom(
            common_fault.FaultDelay(
                fixed_delay=duration(fault.delay.fixed_delay),
                percentage=_percent(fault.delay.percent),
            )
        )
    if fault.abort is not None:
        a = fault.abort
        abort = fault_pb2.FaultAbort(percentage=_percent(a.percent))
        if a.http_status is not None:
            abort.http_status = a.http_status
        else:
            abort.grpc_status = a.grpc_status
        out.abort.CopyFrom(abort)
    if fault.version is not None:
        out.upstream_cluster = names.outbound_cluster(fault.service, fault.version)
    if fault.header is not None:
        out.headers.append(
            rc.HeaderMatcher(
                name=fault.header, string_match=string_pb2.StringMatcher(exact=fault.header_value)
            )
        )
    return out


def apply(vhost: rc.VirtualHost, fault: Fault | None) -> None:
    if fault is not None:
        vhost.typed_per_filter_config[FILTER_NAME].CopyFrom(pack(http_fault(fault)))

"""Envoy's HTTP fault filter on every sidecar: the listener holds it with no fault; a virtual
host turns a mesh fault on (typed_per_filter_config, pushed by RDS). A service's fault is on its
virtual host at the callers; a fault on one host is on that host's inbound virtual host, after
authz (an unauthenticated call is refused, not delayed)."""

from __future__ import annotations

from collections.abc import Iterable

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
    if fault.version is not None and fault.host is None:
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


def caller_fault(faults: Iterable[Fault], service: str) -> Fault | None:
    """The fault the callers of `service` inject: its fault that names no host."""
    return next((f for f in faults if f.service == service and f.host is None), None)


def host_fault(faults: Iterable[Fault], service: str, version: str, endpoint: str) -> Fault | None:
    """The fault the inbound sidecar serving `endpoint` (`ip:port`) of `service`/`version`
    injects: the one naming that host (and that version, or none)."""
    return next(
        (
            f
            for f in faults
            if f.service == service and f.host == endpoint and f.version in (None, version)
        ),
        None,
    )

"""Envoy's gRPC access log service (envoy.service.accesslog.v3): the caller sidecars stream one
entry per classified call (xds_server/resources/access_log.py `outcome_log`), and each becomes
an outcome of its request class for xds_server/slo/quarantine.py.

Served by the control plane's gRPC server (the ADS port), reached through every sidecar's
`xds_cluster`. Envoy sees what a runtime cannot report itself: crashes, resets, stalls.
"""

from __future__ import annotations

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2 as data_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from mesh_common.headers import CLASS_HEADER
from xds_server.resources.routes import quarantine_route_name
from xds_server.rollout.gates.envoy_stats import SERVER_FAULT_CODES
from xds_server.slo.quarantine import Isolation

# Response flags that are the upstream's fault. Not: the client leaving (downstream_*), no
# healthy host, overflow or a refused connection (the pool's state, not this class's doing),
# denials and limits.
FAULT_FLAGS = (
    "upstream_request_timeout",
    "upstream_remote_reset",
    "upstream_connection_termination",
    "upstream_protocol_error",
    "upstream_max_stream_duration_reached",
    "stream_idle_timeout",
    "duration_timeout",
    "local_reset",
)


# A call that found the pool down says nothing about its class: the runtime side's Envoy
# answers it with one of these in grpc-message (its local reply's body), and so does ours.
NOT_THE_CLASS = (
    "connection failure",  # "reset reason: [remote ]connection failure": nothing listened
    "no healthy upstream",
    "upstream overflow",
)
UNAVAILABLE = "14"
MID_STREAM = ("upstream_remote_reset", "upstream_connection_termination")
NOT_THE_CLASS_FLAGS = ("no_healthy_upstream", "upstream_overflow", "upstream_connection_failure")


def outcome(entry: data_pb2.HTTPAccessLogEntry) -> tuple[str, str, bool, bool, str] | None:
    """(service, class, failed, rerouted, reason) of one entry; None when it has no class or
    tells nothing about its class (the pool was down when it came)."""
    key = entry.request.request_headers.get(CLASS_HEADER, "")
    service = entry.request.authority.rsplit(":", 1)[0]
    if not key or not service:
        return None
    rerouted = entry.common_properties.route_name == quarantine_route_name(service, key)
    flags = entry.common_properties.response_flags
    resp = entry.response
    message = resp.response_trailers.get("grpc-message") or resp.response_headers.get(
        "grpc-message", ""
    )
    if any(getattr(flags, f) for f in NOT_THE_CLASS_FLAGS) or any(
        m in message for m in NOT_THE_CLASS
    ):
        return None
    for name in FAULT_FLAGS:
        if getattr(flags, name):
            if name in MID_STREAM and entry.common_properties.HasField(
                "time_to_first_upstream_rx_byte"
            ):
                # The runtime was already answering this call when it died: it was in flight
                # beside whatever killed it (a query of death kills before its first token).
                return None
            return service, key, True, rerouted, name
    if flags.downstream_remote_reset or flags.downstream_connection_termination:
        return service, key, False, rerouted, "the caller left"
    status = resp.response_trailers.get("grpc-status") or resp.response_headers.get("grpc-status")
    if status == UNAVAILABLE and "reset reason: " not in message:
        # The pool's state (loading, draining, shedding: "retry later"), not this call's doing;
        # a runtime that died with the call in flight shows as Envoy's reset instead.
        return None
    if status is not None:
        reason = f"grpc-status {status}"
        if "reset reason: " in message:  # Envoy's own words, never the caller's text
            reason += f" ({message.split('reset reason: ', 1)[1][:60]})"
        return service, key, status in SERVER_FAULT_CODES, rerouted, reason
    code = resp.response_code.value
    return service, key, code >= 500 or code == 0, rerouted, f"HTTP {code}"


class AccessLogServicer(als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self, isolation: Isolation) -> None:
        self.isolation = isolation

    async def StreamAccessLogs(self, request_iterator, context) -> als_pb2.StreamAccessLogsResponse:
        async for msg in request_iterator:
            for entry in msg.http_logs.log_entry:
                got = outcome(entry)
                if got is not None:
                    service, key, failed, rerouted, reason = got
                    self.isolation.observe(service, key, failed, rerouted=rerouted, reason=reason)
        return als_pb2.StreamAccessLogsResponse()


def add_to_server(server: grpc.aio.Server, servicer: AccessLogServicer) -> None:
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(servicer, server)

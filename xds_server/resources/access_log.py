"""JSON access logs for a sidecar listener (HCM `access_log`): one line per request.

What a line holds is chosen so it can be shipped anywhere: never the API key, the
`authorization` header, the session (hash) header or any body. The tenant is logged only on an
inbound listener with authz, where the filter has replaced any client-sent tenant header with
the verified one (`%REQ(...)%` reads the request headers as they are after the filters). On
an mTLS inbound listener a line names the caller by the SPIFFE ID its certificate proved.
"""

from __future__ import annotations

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import base_pb2, config_source_pb2, grpc_service_pb2
from envoy.config.core.v3 import substitution_format_string_pb2 as sfs
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.extensions.access_loggers.file.v3 import file_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2
from envoy.type.matcher.v3 import string_pb2
from google.protobuf import struct_pb2

from mesh_common.headers import CLASS_HEADER, TENANT_HEADER
from xds_server import mesh as m
from xds_server.resources.common import duration, pack
from xds_server.resources.ratelimit import XDS_CLUSTER

# Envoy access-log command operators; a value that is one command keeps its type (numbers).
FIELDS = {
    "start_time": "%START_TIME%",
    "method": "%REQ(:METHOD)%",
    "path": "%PATH(WQ)%",
    "authority": "%REQ(:AUTHORITY)%",
    "protocol": "%PROTOCOL%",
    "response_code": "%RESPONSE_CODE%",
    "grpc_status": "%GRPC_STATUS_NUMBER%",
    "response_flags": "%RESPONSE_FLAGS%",
    "upstream_cluster": "%UPSTREAM_CLUSTER%",
    "upstream_host": "%UPSTREAM_HOST%",
    "duration_ms": "%DURATION%",
    "bytes_received": "%BYTES_RECEIVED%",
    "bytes_sent": "%BYTES_SENT%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "traceparent": "%REQ(TRACEPARENT)%",
}


def access_logs(
    cfg: m.AccessLog, listener: str, *, inbound: bool, tenant: bool, peer: bool = False
) -> list[accesslog_pb2.AccessLog]:
    """The HCM `access_log` list for `listener` ([] when the mesh turns its side's logs off).
    `peer`: the listener takes mTLS only, so each line names the caller's verified SPIFFE ID."""
    calls = cfg.inbound if inbound else cfg.outbound
    if not cfg.enabled or calls == "off":
        return []
    fields: dict[str, str] = {"listener": listener, **FIELDS}
    if tenant:
        fields["tenant"] = f"%REQ({TENANT_HEADER.upper()})%"
    if peer:
        fields["downstream_peer_uri_san"] = "%DOWNSTREAM_PEER_URI_SAN%"
    fmt = struct_pb2.Struct()
    fmt.update(fields)
    log_format = sfs.SubstitutionFormatString(json_format=fmt)
    if cfg.path is None:
        name, typed = (
            "envoy.access_loggers.stdout",
            stream_pb2.StdoutAccessLog(log_format=log_format),
        )
    else:
        name, typed = (
            "envoy.access_loggers.file",
            file_pb2.FileAccessLog(path=cfg.path, log_format=log_format),
        )
    only = failures() if calls == "failures" else None
    return [accesslog_pb2.AccessLog(name=name, filter=only, typed_config=pack(typed))]


def failures() -> accesslog_pb2.AccessLogFilter:
    """Calls that did not succeed: an HTTP status of 400 or more, any response flag (Envoy's
    own failures: no upstream, reset, timeout...), or a gRPC call that ended with a status other
    than OK (a gRPC error, a denial included, is HTTP 200 with `grpc-status`). Envoy reads the
    status from the trailers, else from the headers of a trailers-only reply; a non-gRPC call
    would count as UNKNOWN, hence the content-type."""
    grpc_call = accesslog_pb2.AccessLogFilter(
        header_filter=accesslog_pb2.HeaderFilter(
            header=rc.HeaderMatcher(
                name="content-type",
                string_match=string_pb2.StringMatcher(prefix="application/grpc"),
            )
        )
    )
    not_ok = accesslog_pb2.AccessLogFilter(
        grpc_status_filter=accesslog_pb2.GrpcStatusFilter(
            statuses=[accesslog_pb2.GrpcStatusFilter.OK], exclude=True
        )
    )
    http_error = accesslog_pb2.AccessLogFilter(
        status_code_filter=accesslog_pb2.StatusCodeFilter(
            comparison=accesslog_pb2.ComparisonFilter(
                op=accesslog_pb2.ComparisonFilter.GE,
                value=base_pb2.RuntimeUInt32(
                    default_value=400, runtime_key="meshlm.access_log.failure_status"
                ),
            )
        )
    )
    any_flag = accesslog_pb2.AccessLogFilter(
        response_flag_filter=accesslog_pb2.ResponseFlagFilter()
    )
    grpc_error = accesslog_pb2.AccessLogFilter(
        and_filter=accesslog_pb2.AndFilter(filters=[grpc_call, not_ok])
    )
    return accesslog_pb2.AccessLogFilter(
        or_filter=accesslog_pb2.OrFilter(filters=[http_error, any_flag, grpc_error])
    )


# Outcomes per request class, streamed to the control plane's AccessLogService:
# only calls that carry a class header, with the gRPC status from the trailers (or the headers
# of a trailers-only reply); response flags and the upstream cluster come with every entry.
OUTCOME_LOG_NAME = "meshlm-isolation"
OUTCOME_FLUSH_S = 0.2  # Envoy's default is 1 s: a query of death should trip within seconds


def outcome_log() -> accesslog_pb2.AccessLog:
    cfg = als_pb2.HttpGrpcAccessLogConfig(
        common_config=als_pb2.CommonGrpcAccessLogConfig(
            log_name=OUTCOME_LOG_NAME,
            grpc_service=grpc_service_pb2.GrpcService(
                envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=XDS_CLUSTER)
            ),
            transport_api_version=config_source_pb2.V3,
            buffer_flush_interval=duration(OUTCOME_FLUSH_S),
        ),
        additional_request_headers_to_log=[CLASS_HEADER],
        additional_response_headers_to_log=["grpc-status", "grpc-message"],
        additional_response_trailers_to_log=["grpc-status", "grpc-message"],
    )
    present = accesslog_pb2.AccessLogFilter(
        header_filter=accesslog_pb2.HeaderFilter(
            header=rc.HeaderMatcher(name=CLASS_HEADER, present_match=True)
        )
    )
    return accesslog_pb2.AccessLog(
        name="envoy.access_loggers.http_grpc", filter=present, typed_config=pack(cfg)
    )

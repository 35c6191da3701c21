"""Listener with an HTTP connection manager for gRPC: HTTP/2, grpc_stats (caller side), authz
slot, router."""

from __future__ import annotations

from collections.abc import Sequence

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import (
    base_pb2,
    config_source_pb2,
    extension_pb2,
    protocol_pb2,
    substitution_format_string_pb2,
)
from envoy.config.listener.v3 import listener_components_pb2 as lc
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2
from envoy.extensions.filters.http.buffer.v3 import buffer_pb2
from envoy.extensions.filters.http.grpc_stats.v3 import config_pb2 as grpc_stats_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    header_mutation_pb2 as early_pb2,
)
from google.protobuf import struct_pb2, wrappers_pb2

from mesh_common.type_urls import WASM as WASM_TYPE_URL
from xds_server.resources.common import ads, duration, pack, socket_address, u32

HCM = hcm_pb2.HttpConnectionManager
HttpFilter = hcm_pb2.HttpFilter
BUFFER_FILTER = "envoy.filters.http.buffer"
# An inbound request's headers, and the whole request (headers and body), must arrive within
# these: a client trickling bytes holds the sidecar's stream no longer (the runtime's own
# server has the same deadline, mesh_common/http_server.py). The timer stops once the request
# has gone upstream or the response has begun: long answers and token streams are not cut.
REQUEST_HEADERS_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 30.0


def grpc_stats_filter() -> HttpFilter:
    # Per-method success/failure counters by grpc-status: what the rollout gates and the SLO
    # loop read, on caller sidecars only (xds_server/rollout/gates/). No filter state: nothing
    # reads it.
    cfg = grpc_stats_pb2.FilterConfig(stats_for_all_methods=wrappers_pb2.BoolValue(value=True))
    return HttpFilter(name="envoy.filters.http.grpc_stats", typed_config=pack(cfg))


def buffer_filter(max_request_bytes: int) -> HttpFilter:
    """Envoy holds a request until its whole body arrived (413 past `max_request_bytes`), and
    only then picks an upstream connection: a slow body holds no connection of the runtime, and
    the request goes upstream with a content-length. Off unless a route turns it on
    (routes.inbound_route_config: the OpenAI HTTP API's; gRPC calls stream)."""
    return HttpFilter(
        name=BUFFER_FILTER,
        typed_config=pack(buffer_pb2.Buffer(max_request_bytes=u32(max_request_bytes))),
        disabled=True,
    )


def router_filter() -> HttpFilter:
    return HttpFilter(name="envoy.filters.http.router", typed_config=pack(router_pb2.Router()))


def ecds_filter(name: str, type_urls: Sequence[str] = (WASM_TYPE_URL,)) -> HttpFilter:
    """A filter whose config comes by ECDS. No default and no warming without it: a listener
    whose authz config has not arrived never serves (fails closed)."""
    return HttpFilter(
        name=name,
        config_discovery=config_source_pb2.ExtensionConfigSource(
            config_source=ads(),
            type_urls=list(type_urls),
            apply_default_config_without_warming=False,
        ),
    )


def remove_request_headers(headers: Sequence[str]) -> extension_pb2.TypedExtensionConfig:
    """An HCM early header mutation: runs before any filter and before route selection."""
    mutations = [mutation_rules_pb2.HeaderMutation(remove=h) for h in headers]
    return extension_pb2.TypedExtensionConfig(
        name="envoy.http.early_header_mutation.header_mutation",
        typed_config=pack(early_pb2.HeaderMutation(mutations=mutations)),
    )


# Envoy's response flag for an upstream connection that closed with the request already sent
# (https://www.envoyproxy.io/docs/envoy/latest/configuration/observability/access_log/usage,
# %RESPONSE_FLAGS%): here, a runtime that died while holding the call.
DIED_HOLDING_THE_CALL = ("UC",)


def died_holding_the_call_reply() -> hcm_pb2.LocalReplyConfig:
    """The inbound sidecar answers a call whose runtime died while holding it with HTTP 500
    (gRPC UNKNOWN, a server fault) instead of Envoy's 503 (UNAVAILABLE), so the caller's
    `retry_on: unavailable` does not resend it to another replica: a query of death would
    walk the pool. A runtime that was down before the call (UF, UH) stays
    UNAVAILABLE, retried: that call provably reached no runtime."""
    flags = accesslog_pb2.ResponseFlagFilter(flags=list(DIED_HOLDING_THE_CALL))
    mapper = hcm_pb2.ResponseMapper(
        filter=accesslog_pb2.AccessLogFilter(response_flag_filter=flags),
        status_code=wrappers_pb2.UInt32Value(value=500),
    )
    return hcm_pb2.LocalReplyConfig(mappers=[mapper])


# Envoy's own refusals of an OpenAI HTTP call: the callers RBAC's 403, a 503 when no
# replica answers, a 404 when no route matches, a timeout's 504... Their plain-text bodies become
# OpenAI's error JSON, which the SDKs read `code` and `type` from. Only on /v1/ paths (gRPC keeps
# its trailers-only answer) and only when the reply is not JSON already: the Wasm authz filter's
# denials are OpenAI-shaped and carry `content-type: application/json` (wasm_filters/authz.zig).
# The filter runs for local replies only (https://www.envoyproxy.io/docs/envoy/latest/
# configuration/http/http_conn_man/local_reply): a CEL expression, as no AccessLogFilter of
# Envoy's own reads a response header.
OPENAI_LOCAL_REPLY = (
    "request.path.startsWith('/v1/') && !('content-type' in response.headers && "
    "response.headers['content-type'].startsWith('application/json'))"
)
# HTTP status -> OpenAI error type and code, as model_runtime/serving/openai_api.py has them.
OPENAI_REFUSALS = {
    403: ("permission_error", "access_denied"),
    404: ("invalid_request_error", "no_route"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("server_error", "service_unavailable"),
    504: ("server_error", "timeout"),
}
# Say what found no route; the caller sidecar's 404 body (routes.no_service_message) says how
# to name a service.
NO_ROUTE_MESSAGE = (
    "no route for %REQ(:METHOD)% %REQ(:PATH)% at %REQ(:AUTHORITY)%: %LOCAL_REPLY_BODY%"
)


def _openai_error_format(status: int) -> substitution_format_string_pb2.SubstitutionFormatString:
    """The body of an OpenAI error for `status`; one not in OPENAI_REFUSALS is typed by its
    class and coded by Envoy's response code details."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    type_, code = OPENAI_REFUSALS.get(status, (kind, "%RESPONSE_CODE_DETAILS%"))
    error = struct_pb2.Struct()
    error.update({
        "message": NO_ROUTE_MESSAGE if status == 404 else "%LOCAL_REPLY_BODY%",
        "type": type_,
        "code": code,
    })  # fmt: skip
    error.fields["param"].null_value = struct_pb2.NULL_VALUE
    body = struct_pb2.Struct()
    body.fields["error"].struct_value.CopyFrom(error)
    return substitution_format_string_pb2.SubstitutionFormatString(json_format=body)


def _openai_call() -> accesslog_pb2.AccessLogFilter:
    cel = cel_pb2.ExpressionFilter(expression=OPENAI_LOCAL_REPLY)
    return accesslog_pb2.AccessLogFilter(
        extension_filter=accesslog_pb2.ExtensionFilter(
            name="envoy.access_loggers.extension_filters.cel", typed_config=pack(cel)
        )
    )


def _status_is(
    code: int, op: int = accesslog_pb2.ComparisonFilter.EQ
) -> accesslog_pb2.AccessLogFilter:
    cmp = accesslog_pb2.ComparisonFilter(
        op=op,
        value=base_pb2.RuntimeUInt32(
            default_value=code, runtime_key=f"meshlm.openai_reply.status_{code}"
        ),
    )
    return accesslog_pb2.AccessLogFilter(
        status_code_filter=accesslog_pb2.StatusCodeFilter(comparison=cmp)
    )


def _both(*filters: accesslog_pb2.AccessLogFilter) -> accesslog_pb2.AccessLogFilter:
    return accesslog_pb2.AccessLogFilter(and_filter=accesslog_pb2.AndFilter(filters=filters))


def openai_local_reply(base: hcm_pb2.LocalReplyConfig | None) -> hcm_pb2.LocalReplyConfig:
    """`base`'s mappers, each with an OpenAI-shaped twin for /v1/ calls first (a status it sets
    gets that status's error), then one mapper per status of Envoy's own refusals there, then
    any other status. The first mapper whose filter matches decides."""
    mappers = list(base.mappers) if base else []
    twins = []
    for mapper in mappers:
        twin = hcm_pb2.ResponseMapper()
        twin.CopyFrom(mapper)
        twin.filter.CopyFrom(_both(_openai_call(), mapper.filter))
        # A mapper that keeps Envoy's status: server_error, coded by the response details.
        status = mapper.status_code.value if mapper.HasField("status_code") else 500
        twin.body_format_override.CopyFrom(_openai_error_format(status))
        twins.append(twin)
    by_status = [
        hcm_pb2.ResponseMapper(
            filter=_both(_openai_call(), _status_is(status)),
            body_format_override=_openai_error_format(status),
        )
        for status in OPENAI_REFUSALS
    ]
    rest = [
        hcm_pb2.ResponseMapper(
            filter=_both(_openai_call(), _status_is(500, accesslog_pb2.ComparisonFilter.GE)),
            body_format_override=_openai_error_format(500),
        ),
        hcm_pb2.ResponseMapper(
            filter=_openai_call(), body_format_override=_openai_error_format(400)
        ),
    ]
    return hcm_pb2.LocalReplyConfig(mappers=[*twins, *by_status, *rest, *mappers])


def forward_client_cert() -> dict[str, object]:
    """The HCM fields that hand the runtime its verified caller, as Istio does: Envoy replaces
    any client-sent `x-forwarded-client-cert` with `By=<this sidecar's SPIFFE ID>;Hash=<the
    client certificate's SHA-256>;URI=<the caller's SPIFFE ID>` from the TLS connection, in
    every authz mode (the Wasm filter's `x-meshlm-principal` exists only in mode wasm). Without
    mTLS the default, SANITIZE, drops a client's header."""
    return {
        "forward_client_cert_details": HCM.SANITIZE_SET,
        "set_current_client_cert_details": HCM.SetCurrentClientCertDetails(uri=True),
    }


def http_listener(
    name: str,
    *,
    host: str,
    port: int,
    route_config_name: str,
    stat_prefix: str,
    stream_idle_timeout: float,
    authz_filters: Sequence[HttpFilter] = (),
    access_log: Sequence[accesslog_pb2.AccessLog] = (),
    strip_request_headers: Sequence[str] = (),
    local_reply: hcm_pb2.LocalReplyConfig | None = None,
    grpc_stats: bool = True,
    transport_socket: base_pb2.TransportSocket | None = None,
    body_filters: Sequence[HttpFilter] = (),
    request_deadlines: bool = False,
) -> listener_pb2.Listener:
    """`transport_socket`: mTLS for every connection (xds_server/resources/tls.py); a client
    that does not complete the handshake reaches no filter, and the upstream learns the
    verified caller from `x-forwarded-client-cert`. `body_filters` run after authz (a denied
    request's body is never held). `request_deadlines`: REQUEST_HEADERS_TIMEOUT_S and
    REQUEST_TIMEOUT_S for every request."""
    stats = [grpc_stats_filter()] if grpc_stats else []
    deadlines = (
        {
            "request_headers_timeout": duration(REQUEST_HEADERS_TIMEOUT_S),
            "request_timeout": duration(REQUEST_TIMEOUT_S),
        }
        if request_deadlines
        else {}
    )
    hcm = HCM(
        stat_prefix=stat_prefix,
        codec_type=HCM.AUTO,  # h2c prior knowledge for gRPC; HTTP/1.1 still answered
        rds=hcm_pb2.Rds(config_source=ads(), route_config_name=route_config_name),
        http_filters=[*stats, *authz_filters, *body_filters, router_filter()],
        http2_protocol_options=protocol_pb2.Http2ProtocolOptions(),
        stream_idle_timeout=duration(stream_idle_timeout),
        common_http_protocol_options=protocol_pb2.HttpProtocolOptions(idle_timeout=duration(3600)),
        access_log=list(access_log),
        early_header_mutation_extensions=(
            [remove_request_headers(strip_request_headers)] if strip_request_headers else []
        ),
        local_reply_config=openai_local_reply(local_reply),
        **(forward_client_cert() if transport_socket else {}),
        **deadlines,
        # No `tracing` block: W3C `traceparent`/`tracestate` are ordinary headers that Envoy
        # forwards unchanged hop to hop, so the runtime continues the client's trace.
    )
    return listener_pb2.Listener(
        name=name,
        address=socket_address(host, port),
        # Envoy defaults to SO_REUSEPORT on Linux: a second sidecar on this port would bind too
        # and take half the connections. Without it the second one fails "address in use".
        enable_reuse_port=wrappers_pb2.BoolValue(value=False),
        filter_chains=[
            lc.FilterChain(
                filters=[
                    lc.Filter(
                        name="envoy.filters.network.http_connection_manager",
                        typed_config=pack(hcm),
                    )
                ],
                transport_socket=transport_socket,
            )
        ],
    )

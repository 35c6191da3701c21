"""Listener with an HTTP connection manager for gRPC: HTTP/2, grpc_stats (caller side), authz
slot, router."""

from __future__ import annotations

from collections.abc import Sequence

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import base_pb2, config_source_pb2, extension_pb2, protocol_pb2
from envoy.config.listener.v3 import listener_components_pb2 as lc
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.http.grpc_stats.v3 import config_pb2 as grpc_stats_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    header_mutation_pb2 as early_pb2,
)
from google.protobuf import wrappers_pb2

from xds_server.resources.common import ads, duration, pack, socket_address

HCM = hcm_pb2.HttpConnectionManager
HttpFilter = hcm_pb2.HttpFilter
WASM_TYPE_URL = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"


def grpc_stats_filter() -> HttpFilter:
    # Per-method success/failure counters by grpc-status: what the rollout gates and the SLO
    # loop read, on caller sidecars only (xds_server/gates.py). No filter state: nothing reads it.
    cfg = grpc_stats_pb2.FilterConfig(stats_for_all_methods=wrappers_pb2.BoolValue(value=True))
    return HttpFilter(name="envoy.filters.http.grpc_stats", typed_config=pack(cfg))


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
    walk the pool (issue 11). A runtime that was down before the call (UF, UH) stays
    UNAVAILABLE, retried: that call provably reached no runtime."""
    flags = accesslog_pb2.ResponseFlagFilter(flags=list(DIED_HOLDING_THE_CALL))
    mapper = hcm_pb2.ResponseMapper(
        filter=accesslog_pb2.AccessLogFilter(response_flag_filter=flags),
        status_code=wrappers_pb2.UInt32Value(value=500),
    )
    return hcm_pb2.LocalReplyConfig(mappers=[mapper])


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
) -> listener_pb2.Listener:
    """`transport_socket`: mTLS for every connection (xds_server/resources/tls.py); a client
    that does not complete the handshake reaches no filter, and the upstream learns the
    verified caller from `x-forwarded-client-cert`."""
    stats = [grpc_stats_filter()] if grpc_stats else []
    hcm = HCM(
        stat_prefix=stat_prefix,
        codec_type=HCM.AUTO,  # h2c prior knowledge for gRPC; HTTP/1.1 still answered
        rds=hcm_pb2.Rds(config_source=ads(), route_config_name=route_config_name),
        http_filters=[*stats, *authz_filters, router_filter()],
        http2_protocol_options=protocol_pb2.Http2ProtocolOptions(),
        stream_idle_timeout=duration(stream_idle_timeout),
        common_http_protocol_options=protocol_pb2.HttpProtocolOptions(idle_timeout=duration(3600)),
        access_log=list(access_log),
        early_header_mutation_extensions=(
            [remove_request_headers(strip_request_headers)] if strip_request_headers else []
        ),
        local_reply_config=local_reply,
        **(forward_client_cert() if transport_socket else {}),
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

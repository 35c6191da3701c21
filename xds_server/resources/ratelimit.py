"""The inbound listener's global tier of tenant rate limits: Envoy's `envoy.filters.http.ratelimit`
asking the control plane's RateLimitService (xds_server/ratelimit.py) after the authz filter."""

from __future__ import annotations

from envoy.config.core.v3 import config_source_pb2, grpc_service_pb2
from envoy.config.ratelimit.v3 import rls_pb2 as rls_config_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)

from xds_server.ratelimit import DOMAIN, SERVICE_KEY, TENANT_KEY
from xds_server.resources.common import duration, pack
from xds_server.resources.names import TENANT_HEADER

XDS_CLUSTER = "xds_cluster"  # sidecar/bootstrap.py: every sidecar's static way to the control plane
# Envoy's default (20 ms) lets calls through unlimited whenever the control plane is briefly
# slow; a hung control plane costs each limited call this much at most.
TIMEOUT_S = 0.25
Action = rc.RateLimit.Action


def ratelimit_filter(service: str) -> hcm_pb2.HttpFilter:
    """One descriptor per request, `[(tenant, x-meshlm-tenant), (service, <service>)]`: the
    verified tenant header the authz filter set (client-sent copies are dropped earlier)."""
    cfg = rate_limit_pb2.RateLimit(
        domain=DOMAIN,
        timeout=duration(TIMEOUT_S),
        # The control plane down: the authz filter's per-sidecar buckets still hold.
        failure_mode_deny=False,
        rate_limited_as_resource_exhausted=True,  # gRPC callers see RESOURCE_EXHAUSTED
        rate_limit_service=rls_config_pb2.RateLimitServiceConfig(
            grpc_service=grpc_service_pb2.GrpcService(
                envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=XDS_CLUSTER)
            ),
            transport_api_version=config_source_pb2.V3,
        ),
        rate_limits=[
            rc.RateLimit(
                actions=[
                    Action(
                        request_headers=Action.RequestHeaders(
                            header_name=TENANT_HEADER, descriptor_key=TENANT_KEY
                        )
                    ),
                    Action(
                        generic_key=Action.GenericKey(
                            descriptor_key=SERVICE_KEY, descriptor_value=service
                        )
                    ),
                ]
            )
        ],
    )
    return hcm_pb2.HttpFilter(name="envoy.filters.http.ratelimit", typed_config=pack(cfg))

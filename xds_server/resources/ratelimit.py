"""Tenant rate limits on an inbound sidecar.

`rate_limits.mode: local` (the default): the authz filter's per-sidecar token buckets carry
this sidecar's share of each tenant's mesh-wide limit (`local_policy`): the limit divided among
the service's live inbound sidecars, which the control plane counts from ADS and re-divides as
they join or leave (xds_server/ratelimit/shares.py). No call leaves the sidecar. A tenant's token
budget is divided the same way; the filter hands the share to the runtime, which reserves from
it (model_runtime/serving/budgets.py).

`global`: Envoy's `envoy.filters.http.ratelimit` after the authz filter asks the control plane's
RateLimitService (xds_server/ratelimit/service.py) on every call (`ratelimit_filter`); the authz
filter's buckets keep each tenant's whole limit, as the tier that holds while the control plane
is down. Token budgets likewise: runtimes reserve at the control plane
(xds_server/ratelimit/budgets.py) and keep the whole budget as their own tier.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from envoy.config.core.v3 import config_source_pb2, grpc_service_pb2
from envoy.config.ratelimit.v3 import rls_pb2 as rls_config_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)

from mesh_common.headers import TENANT_HEADER
from xds_server import mesh as m
from xds_server.ratelimit.service import DOMAIN, SERVICE_KEY, TENANT_KEY, Limit, limit_in_force
from xds_server.resources.common import duration, pack

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


# The authz filter refuses a fill interval over a day (wasm_filters/policy.py, authz.zig).
MAX_FILL_INTERVAL_MS = 86_400_000


def share(limit: Limit, sidecars: int) -> Limit:
    """One of `sidecars` equal shares of `limit`, in whole tokens. The rate is never above
    1/N of the limit's (the fill interval is stretched to fit whole tokens) unless that takes
    a fill interval over a day, the longest the filter takes. A
    bucket holds max_tokens // N, and at least one fill, so the N buckets together may hold a
    little more than max_tokens (at most N - 1 tokens when max_tokens >= tokens_per_fill)."""
    if sidecars <= 1:
        return limit
    per_fill = math.ceil(limit.tokens_per_fill / sidecars)
    interval = math.ceil(limit.fill_interval_ms * sidecars * per_fill / limit.tokens_per_fill)
    return dataclasses.replace(
        limit,  # type: ignore[type-var]
        max_tokens=max(per_fill, limit.max_tokens // sidecars),
        tokens_per_fill=per_fill,
        fill_interval_ms=min(interval, MAX_FILL_INTERVAL_MS),
    )


def local_policy(mesh: m.Mesh, svc: m.Service) -> Any:
    """The tenants (a wasm_filters.policy.Policy) whose limits the authz filter of one inbound
    sidecar of `svc` enforces: in `local` mode each tenant's limit in force (the SLO loop may
    shed it) divided among the service's inbound sidecars; in `global` mode their own limits."""
    policy = mesh.tenants
    if mesh.rate_limits.mode != "local":
        return _global_budgets(policy, svc.name)
    tenants = []
    for t in policy.tenants:
        limit = limit_in_force(t, svc)
        if limit is not None:
            limit = share(limit, svc.inbound_sidecars)
        budget = budget_share(t.token_budget, svc.inbound_sidecars)
        if limit is not t.rate_limit or budget is not t.token_budget:
            t = dataclasses.replace(t, rate_limit=limit, token_budget=budget)
        tenants.append(t)
    return dataclasses.replace(policy, tenants=tuple(tenants))


def _global_budgets(policy: Any, service: str) -> Any:
    """`policy` with each token budget marked as kept mesh-wide by the control plane."""
    if policy is None or not any(t.token_budget for t in policy.tenants):
        return policy
    tenants = tuple(
        t
        if t.token_budget is None
        else dataclasses.replace(
            t, token_budget=dataclasses.replace(t.token_budget, global_service=service)
        )
        for t in policy.tenants
    )
    return dataclasses.replace(policy, tenants=tenants)


def budget_share(budget: Any, sidecars: int) -> Any:
    """One of `sidecars` shares of a tenant's token budget (a wasm_filters.policy.TokenBudget),
    rounded down: the sidecars' runtimes together never admit more than the budget."""
    if budget is None or sidecars <= 1:
        return budget
    parts = {k: v for k, v in vars(budget).items() if k.startswith("tokens_") and v is not None}
    return dataclasses.replace(budget, **{k: max(1, v // sidecars) for k, v in parts.items()})

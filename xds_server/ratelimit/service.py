"""Mesh-wide tenant rate limits, exact: Envoy's `envoy.service.ratelimit.v3.RateLimitService`.

Only with `rate_limits: {mode: global}` in the mesh file (the default, `local`, divides each
limit among the sidecars instead: xds_server/resources/ratelimit.py). Then each inbound
sidecar's `envoy.filters.http.ratelimit` asks here, after the authz filter, on every call, with
one descriptor `[(tenant, <verified x-meshlm-tenant>), (service, <service>)]`. One token bucket
per (service, tenant) for the whole mesh, with the tenant's `rate_limit` from the control plane's
current mesh, so an `apply` changes limits at once and replicas do not multiply them. The
authz filter's per-sidecar buckets stay as the local tier: Envoy asks here with
`failure_mode_deny: false`, so while this service is unreachable a tenant gets at most
N x its limit through N sidecars of a service, and exactly its limit otherwise.

Served by the control plane's gRPC server (the ADS port): sidecars reach it through the
`xds_cluster` of their bootstrap, so there is no extra process or port.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from xds_server import mesh as m
from xds_server.xds.peer import workload

DOMAIN = "meshlm"
TENANT_KEY = "tenant"
SERVICE_KEY = "service"
OVER_LIMIT_MESSAGE = b"tenant rate limit exceeded (mesh-wide)"
MAX_DESCRIPTORS = 8  # Envoy sends one per request; more is not a sidecar of ours
Code = rls_pb2.RateLimitResponse.Code


class Limit(Protocol):
    """A tenant's `rate_limit` (wasm_filters.policy.RateLimit, names from Envoy's TokenBucket)."""

    max_tokens: int
    tokens_per_fill: int
    fill_interval_ms: int


@dataclass(frozen=True)
class ShedLimit:
    """A tenant shed by the SLO loop (xds_server/slo/loop.py): SHED_FRACTION of its own limit, or
    one call a second when it has none; bounded, and gone when the loop undoes it."""

    max_tokens: int
    tokens_per_fill: int
    fill_interval_ms: int


SHED_FRACTION = 4  # a shed tenant keeps a quarter of its rate


def shed(limit: Limit | None) -> ShedLimit:
    if limit is None:
        return ShedLimit(1, 1, 1000)
    return ShedLimit(
        max(1, limit.max_tokens // SHED_FRACTION),
        max(1, limit.tokens_per_fill // SHED_FRACTION),
        limit.fill_interval_ms,
    )


def limit_in_force(tenant: Any, svc: m.Service) -> Limit | None:
    """`tenant`'s limit on `svc`: its own `rate_limit`, or less while the SLO loop sheds it."""
    if tenant.name in svc.slo_state.shed_tenants:
        return shed(tenant.rate_limit)
    return tenant.rate_limit


@dataclass
class _Bucket:
    tokens: int
    last_ns: int


class TokenBuckets:
    """Token buckets keyed by (service, tenant), refilled as the authz filter's are: whole
    fills of `tokens_per_fill` every `fill_interval`, never above `max_tokens`."""

    def __init__(self, clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self._clock_ns = clock_ns
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._lock = threading.Lock()

    def take(self, key: tuple[str, str], limit: Limit, hits: int) -> tuple[bool, int, float]:
        """Take `hits` tokens from `key`'s bucket, or none when fewer are left.
        Returns (allowed, tokens left, seconds until the next fill)."""
        interval = limit.fill_interval_ms * 1_000_000
        top = limit.max_tokens
        with self._lock:
            now = self._clock_ns()
            b = self._buckets.setdefault(key, _Bucket(tokens=top, last_ns=now))
            fills = (now - b.last_ns) // interval
            if fills > 0:
                b.tokens += fills * limit.tokens_per_fill
                b.last_ns += fills * interval
            b.tokens = min(b.tokens, top)  # also clamps after an apply lowered max_tokens
            wait_s = (b.last_ns + interval - now) / 1e9
            if b.tokens < hits:
                return False, b.tokens, wait_s
            b.tokens -= hits
            return True, b.tokens, wait_s

    def keep_only(self, keys: set[tuple[str, str]]) -> None:
        """Forget buckets of tenants or services no longer limited (state stays mesh-sized)."""
        with self._lock:
            for k in [k for k in self._buckets if k not in keys]:
                del self._buckets[k]


class RateLimitServicer(rls_pb2_grpc.RateLimitServiceServicer):
    """ShouldRateLimit against the mesh that `current_mesh()` returns at each call."""

    def __init__(
        self,
        current_mesh: Callable[[], m.Mesh],
        buckets: TokenBuckets | None = None,
        trust_domain: str | None = None,
    ) -> None:
        """`trust_domain`: served over mTLS, and a service's buckets are spent only
        by its own inbound sidecars (their certificates hold its service account)."""
        self._mesh = current_mesh
        self._buckets = buckets or TokenBuckets()
        self._trust_domain = trust_domain
        self._seen: m.Mesh | None = None
        self._by_key: dict[tuple[str, str], Limit] = {}

    def _limits(self) -> dict[tuple[str, str], Limit]:
        mesh = self._mesh()
        if mesh is not self._seen:  # a new mesh (apply): new limits, stale buckets dropped
            tenants = getattr(mesh.tenants, "tenants", ())
            self._by_key = {}
            for svc in mesh.services.values():
                for t in tenants:
                    limit = limit_in_force(t, svc)
                    if limit is not None:
                        self._by_key[(svc.name, t.name)] = limit
            self._seen = mesh
            self._buckets.keep_only(set(self._by_key))
        return self._by_key

    async def ShouldRateLimit(
        self, request: rls_pb2.RateLimitRequest, context: grpc.aio.ServicerContext
    ) -> rls_pb2.RateLimitResponse:
        problem = _problem(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        refused = self._refused(request, context)
        if refused:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
        limits = self._limits()
        resp = rls_pb2.RateLimitResponse(overall_code=Code.OK)
        for d in request.descriptors:
            entries = {e.key: e.value for e in d.entries}
            key = (entries[SERVICE_KEY], entries[TENANT_KEY])
            limit = limits.get(key)
            if limit is None:  # no limit for this tenant here (or a policy change in flight)
                resp.statuses.add(code=Code.OK)
                continue
            hits = d.hits_addend.value if d.HasField("hits_addend") else request.hits_addend
            allowed, left, wait_s = self._buckets.take(key, limit, max(hits, 1))
            status = resp.statuses.add(code=Code.OK if allowed else Code.OVER_LIMIT)
            status.limit_remaining = left
            status.duration_until_reset.FromNanoseconds(max(0, round(wait_s * 1e9)))
            if not allowed:
                resp.overall_code = Code.OVER_LIMIT
                resp.raw_body = OVER_LIMIT_MESSAGE  # a gRPC caller's status message
                retry = str(max(1, math.ceil(wait_s)))
                if not resp.response_headers_to_add:
                    resp.response_headers_to_add.add(key="retry-after", value=retry)
        return resp

    def _refused(
        self, request: rls_pb2.RateLimitRequest, context: grpc.aio.ServicerContext
    ) -> str | None:
        if self._trust_domain is None:
            return None
        peer = workload(context, self._trust_domain)
        services = self._mesh().services
        for d in request.descriptors:
            name = next(e.value for e in d.entries if e.key == SERVICE_KEY)
            svc = services.get(name)
            if peer is None or svc is None or svc.service_account != peer.service_account:
                who = peer.spiffe_id if peer else "a client without a workload certificate"
                return f"{who} is not an inbound sidecar of service {name!r}: not its limits"
        return None


def _problem(request: rls_pb2.RateLimitRequest) -> str | None:
    """What makes `request` not one an inbound sidecar of this mesh sends, or None."""
    if request.domain != DOMAIN:
        return f"domain: expected {DOMAIN!r}, got {request.domain!r}"
    if not request.descriptors:
        return "descriptors: at least one is required"
    if len(request.descriptors) > MAX_DESCRIPTORS:
        return f"descriptors: at most {MAX_DESCRIPTORS}, got {len(request.descriptors)}"
    for i, d in enumerate(request.descriptors):
        keys = [e.key for e in d.entries]
        if sorted(keys) != sorted((TENANT_KEY, SERVICE_KEY)):
            return f"descriptors[{i}].entries: expected keys {TENANT_KEY!r} and {SERVICE_KEY!r}"
    return None


def add_to_server(server: grpc.aio.Server, servicer: RateLimitServicer) -> None:
    """Serve ShouldRateLimit on `server` (the control plane's ADS server; one servicer, with
    its buckets, across restarts of that server)."""
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(servicer, server)

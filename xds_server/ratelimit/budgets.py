"""Mesh-wide token budgets, exact: the buckets behind `rate_limits: {mode: global}`.

Runtimes reserve each call's prompt + max_tokens here, keyed by (service, tenant), against the
tenant's `token_budget` in the control plane's current mesh (an `apply` changes it at once), and
settle the unused part when the stream ends (mesh_common/budget_wire.py). Served on the control
plane's gRPC server beside the RateLimitService: a runtime reaches it through its own sidecar, so
with identity on a service's buckets are spent only by its own inbound sidecars.

Reservations live in memory for RESERVATION_TTL_S: one settled later than that (a stream longer
than the longest stream duration a mesh allows) keeps its whole reservation charged, as one
whose runtime died does.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc

from mesh_common import budget_wire as wire
from mesh_common.token_budgets import BudgetExceeded, Reservation, TokenBudgets
from xds_server import mesh as m
from xds_server.xds.peer import workload

RESERVATION_TTL_S = 3600.0
MAX_RESERVATIONS = 100_000  # past it the oldest are dropped (charged): memory stays bounded


class TokenBudgetServicer:
    """Reserve and Settle against the mesh that `current_mesh()` returns at each call."""

    def __init__(
        self,
        current_mesh: Callable[[], m.Mesh],
        trust_domain: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._mesh = current_mesh
        self._trust_domain = trust_domain
        self._clock = clock
        self.buckets = TokenBudgets(where="in the mesh")
        self._held: dict[str, tuple[float, Reservation]] = {}
        self._lock = threading.Lock()

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[..., Any]) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=lambda b: b, response_serializer=wire.encode
            )

        return grpc.method_handlers_generic_handler(
            wire.SERVICE, {wire.RESERVE: unary(self.Reserve), wire.SETTLE: unary(self.Settle)}
        )

    async def Reserve(self, raw: bytes, context: grpc.aio.ServicerContext) -> dict[str, Any]:
        try:
            req = wire.decode(raw, wire.RESERVE_FIELDS)
        except wire.WireError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        mesh = self._mesh()
        svc = mesh.services.get(req["service"])
        if svc is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"service: {req['service']!r}")
        refused = self._refused(svc, context)
        if refused:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
        budget = budget_of(mesh, req["tenant"])
        if budget is None:  # no budget (any more): nothing to hold
            return {"id": ""}
        try:
            key = f"{svc.name}/{req['tenant']}"
            r = self.buckets.reserve(req["tenant"], budget, req["tokens"], key=key)
        except BudgetExceeded as e:
            return {"refused": str(e), "retry_after_s": e.retry_after_s or 0}
        rid = uuid.uuid4().hex
        with self._lock:
            self._expire()
            self._held[rid] = (self._clock(), r)
        return {"id": rid}

    async def Settle(self, raw: bytes, context: grpc.aio.ServicerContext) -> dict[str, Any]:
        try:
            req = wire.decode(raw, wire.SETTLE_FIELDS)
        except wire.WireError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        with self._lock:
            held = self._held.pop(req["id"], None)
        if held is not None:
            self.buckets.settle(held[1], req["used"])
        return {}

    def _expire(self) -> None:
        """Forget reservations past their time (they stay charged); the caller holds the lock."""
        cutoff = self._clock() - RESERVATION_TTL_S
        for rid in list(self._held):
            at, _ = self._held[rid]
            if at >= cutoff and len(self._held) < MAX_RESERVATIONS:
                break  # insertion order is time order
            del self._held[rid]

    def _refused(self, svc: m.Service, context: grpc.aio.ServicerContext) -> str | None:
        if self._trust_domain is None:
            return None
        peer = workload(context, self._trust_domain)
        if peer is None or svc.service_account != peer.service_account:
            who = peer.spiffe_id if peer else "a client without a workload certificate"
            return f"{who} is not an inbound sidecar of service {svc.name!r}: not its budgets"
        return None


def budget_of(mesh: m.Mesh, tenant: str) -> dict[str, int] | None:
    """{budget name: tokens} of `tenant`'s token budget in `mesh`, or None."""
    for t in getattr(mesh.tenants, "tenants", ()):
        if t.name == tenant and t.token_budget is not None:
            parts = vars(t.token_budget).items()
            return {k: v for k, v in parts if k.startswith("tokens_per_") and v is not None}
    return None


def add_to_server(server: grpc.aio.Server, servicer: TokenBudgetServicer) -> None:
    server.add_generic_rpc_handlers((servicer.handler(),))

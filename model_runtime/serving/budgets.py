"""The runtime's side of token budgets: reserve each call's prompt + max_tokens before the engine
sees it, settle the unused part after (mesh_common/token_budgets.py says why that order).

Where the buckets are follows `x-meshlm-token-budget` (the inbound sidecar's authz filter sets it):
- local (`rate_limits.mode: local`): this runtime's own, holding its sidecar's share;
- `global=<service>`: the control plane's, one per (service, tenant) for the mesh, reached at
  `--budget-service` (the sidecar's loopback budget listener, which forwards over the sidecar's
  mTLS to the control plane). While that cannot be reached the runtime keeps the whole budget in
  its own buckets: the tier that holds, as call limits' per-sidecar buckets do in global mode.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from mesh_common import budget_wire as wire
from mesh_common.token_budgets import (
    BudgetError,
    BudgetExceeded,
    Reservation,
    TokenBudgets,
    parse_budget,
)

log = logging.getLogger(__name__)

__all__ = ["BudgetError", "BudgetExceeded", "Budgets", "Held"]

# A hung control plane costs an admitted call this much at most; then the local tier decides.
RESERVE_TIMEOUT_S = 0.25
SETTLE_TIMEOUT_S = 5.0
NO_SERVICE = (
    "the mesh keeps token budgets globally but this runtime has no --budget-service: "
    "enforcing each tenant's whole budget here"
)


@dataclass(frozen=True)
class Held:
    """One call's reservation: in this runtime's buckets, or the control plane's by id."""

    local: Reservation | None = None
    global_id: str = ""


class Budgets:
    """This runtime's token budgets (local buckets, optionally in `state_file`), and the way
    to the control plane's for `global=` budgets."""

    def __init__(self, state_file: Path | None = None, service: str | None = None) -> None:
        self.local = TokenBudgets(state_file)
        self._channel = grpc.insecure_channel(service) if service else None
        self._settler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="budget-settle")
        self._warned = False
        if self._channel is not None:
            ser, de = wire.encode, lambda b: b
            self._reserve = self._channel.unary_unary(
                f"{wire.PATH_PREFIX}{wire.RESERVE}", request_serializer=ser,
                response_deserializer=de,
            )  # fmt: skip
            self._settle = self._channel.unary_unary(
                f"{wire.PATH_PREFIX}{wire.SETTLE}", request_serializer=ser,
                response_deserializer=de,
            )  # fmt: skip

    def reserve(self, tenant: str, header: str, tokens: int) -> Held:
        """Hold `tokens` of `tenant`'s budget named by `header`, or raise BudgetExceeded;
        BudgetError for a header that does not parse."""
        budgets, service = parse_budget(header)
        if service is not None:
            held = self._reserve_globally(service, tenant, tokens)
            if held is not None:
                return held
        return Held(local=self.local.reserve(tenant, budgets, tokens))

    def settle(self, held: Held, used: int) -> None:
        """The call used `used` tokens: refund the rest (to the control plane in the
        background: a stream's end does not wait on it)."""
        if held.local is not None:
            self.local.settle(held.local, used)
        elif held.global_id:
            self._settler.submit(self._settle_globally, held.global_id, used)

    def levels(self) -> dict[str, dict[str, float]]:
        return self.local.levels()

    def close(self) -> None:
        self._settler.shutdown(wait=True)
        if self._channel is not None:
            self._channel.close()

    def _reserve_globally(self, service: str, tenant: str, tokens: int) -> Held | None:
        """The control plane's answer, or None where the local tier must decide."""
        if self._channel is None:
            self._warn_once(NO_SERVICE)
            return None
        req = {"service": service, "tenant": tenant, "tokens": tokens}
        try:
            raw = self._reserve(req, timeout=RESERVE_TIMEOUT_S)
            doc: dict[str, Any] = wire.decode(raw, wire.RESERVED_FIELDS, wire.REFUSED_FIELDS)
        except grpc.RpcError as e:
            self._warn_once(
                f"token budget service unreachable ({e.code().name}): enforcing each tenant's "
                "whole budget here until it answers"
            )
            return None
        except wire.WireError as e:
            log.warning("token budget service: a reply that is not one (%s)", e)
            return None
        if "refused" in doc:
            raise BudgetExceeded(doc["refused"], doc["retry_after_s"] or None)
        return Held(global_id=doc["id"])

    def _settle_globally(self, rid: str, used: int) -> None:
        try:
            self._settle({"id": rid, "used": used}, timeout=SETTLE_TIMEOUT_S)
        except grpc.RpcError as e:  # the reservation stays charged: never more than reserved
            log.warning("token budget service: settle failed (%s)", e.code().name)

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            log.warning("%s", message)
            self._warned = True

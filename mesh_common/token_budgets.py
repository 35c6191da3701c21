"""Token budgets: tokens per minute and per day, reserved before a call runs, refunded after.

Kept by a runtime (`rate_limits.mode: local`, its sidecar's share of each tenant's budget) or by
the control plane for the whole mesh (`global`); the same buckets either way. A call reserves its
prompt tokens + max_tokens under one lock, so concurrent calls at a budget's edge never overshoot
it (LiteLLM's check-then-increment race and charge-after-the-stream overshoot are the failures
this avoids); when the stream ends, fails or is cancelled, the unused part is refunded. Buckets
refill continuously (a minute's budget over a minute), never above the budget.

With a state file the buckets outlive their process: every reservation is written before the
call runs, so a runtime that dies mid-stream has charged the whole reservation (the refund never
comes) and its successor starts from the charged levels, not from full buckets.

`x-meshlm-token-budget`, which the inbound sidecar's authz filter sets after it verified the
caller (inbound listeners drop a client-sent copy before any filter):
`tokens_per_minute=N;tokens_per_day=M[;global=<service>]`, either budget may be missing;
`global=` names the service whose mesh-wide budget the control plane keeps (then N and M are the
whole budget, the tier that holds while the control plane cannot be reached).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Seconds each budget spans: its bucket refills `budget / span` tokens a second.
SPANS = {"tokens_per_minute": 60.0, "tokens_per_day": 86_400.0}


class BudgetError(ValueError):
    """A budget header that does not parse; the message names the part."""


class BudgetExceeded(Exception):
    """A call refused: its reservation does not fit what is left of a budget."""

    def __init__(self, message: str, retry_after_s: int | None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # None: it never fits (max_tokens too large)


GLOBAL = "global"


def parse_budget(value: str) -> tuple[dict[str, int], str | None]:
    """`tokens_per_minute=N;tokens_per_day=M;global=S` -> ({name: N}, S or None); BudgetError
    names a bad part."""
    out: dict[str, int] = {}
    service = None
    for part in value.replace(" ", "").split(";"):
        if not part:
            continue
        name, _, n = part.partition("=")
        if name == GLOBAL and n:
            service = n
            continue
        if name not in SPANS:
            raise BudgetError(f"token budget: unknown part {name!r} (expected {sorted(SPANS)})")
        if not n.isdigit() or int(n) < 1:
            raise BudgetError(f"token budget: {name} must be a positive integer, got {n!r}")
        out[name] = int(n)
    if not out:
        raise BudgetError(f"token budget: names no budget ({value!r})")
    return out, service


@dataclass
class _Bucket:
    level: float
    at: float  # wall-clock seconds of `level` (a successor reads it after a restart)
    budget: int = 0  # the budget it was last used with (0: not since a restart)


@dataclass(frozen=True)
class Reservation:
    tenant: str
    tokens: int
    budgets: tuple[tuple[str, int], ...]  # (name, budget) at admission


class TokenBudgets:
    """Every tenant's buckets on this runtime, optionally kept in `state_file`."""

    def __init__(
        self,
        state_file: Path | None = None,
        clock: Callable[[], float] = time.time,
        where: str = "on this runtime",
    ) -> None:
        self._clock = clock
        self._where = where  # said in refusals: whose buckets these are
        self._state_file = state_file
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        if state_file is not None:
            self._load(state_file)

    def reserve(
        self, tenant: str, budgets: dict[str, int], tokens: int, key: str | None = None
    ) -> Reservation:
        """Take `tokens` from each of the tenant's `budgets` ({name: budget}), or raise
        BudgetExceeded naming the budget and when it holds enough again. `key`: the buckets'
        name where it is not the tenant's (the control plane's are per service and tenant)."""
        tenant_name, tenant = tenant, key or tenant
        with self._lock:
            now = self._clock()
            for name, budget in sorted(budgets.items()):
                if tokens > budget:
                    raise BudgetExceeded(
                        f"token budget: this call reserves {tokens} tokens (prompt + "
                        f"max_tokens), more than tenant {tenant_name!r}'s whole {name} of "
                        f"{budget} {self._where}: lower max_tokens",
                        None,
                    )
            buckets = {n: self._refilled(tenant, n, b, now) for n, b in budgets.items()}
            for name, budget in sorted(budgets.items()):
                b = buckets[name]
                if b.level < tokens:
                    wait = (tokens - b.level) * SPANS[name] / budget
                    raise BudgetExceeded(
                        f"token budget exceeded: tenant {tenant_name!r} has {int(b.level)} of "
                        f"its {name} of {budget} left {self._where}, this call reserves {tokens} "
                        f"(prompt + max_tokens); enough refills in {math.ceil(wait)} s",
                        max(1, math.ceil(wait)),
                    )
            for b in buckets.values():
                b.level -= tokens
            self._save()
        return Reservation(tenant, tokens, tuple(sorted(budgets.items())))

    def settle(self, r: Reservation, used: int) -> None:
        """The call is over, having used `used` tokens: refund the rest of its reservation."""
        refund = r.tokens - max(0, min(used, r.tokens))
        if refund <= 0:
            return
        with self._lock:
            now = self._clock()
            for name, budget in r.budgets:
                b = self._refilled(r.tenant, name, budget, now)
                b.level = min(float(budget), b.level + refund)
            self._save()

    def levels(self) -> dict[str, dict[str, float]]:
        """tenant (or key) -> budget name -> tokens left now, refills counted."""
        with self._lock:
            now = self._clock()
            out: dict[str, dict[str, float]] = {}
            for (tenant, name), b in self._buckets.items():
                refill = max(0.0, now - b.at) * b.budget / SPANS[name]
                left = min(float(b.budget), b.level + refill) if b.budget else b.level
                out.setdefault(tenant, {})[name] = left
            return out

    def _refilled(self, tenant: str, name: str, budget: int, now: float) -> _Bucket:
        b = self._buckets.get((tenant, name))
        if b is None:
            b = self._buckets[(tenant, name)] = _Bucket(float(budget), now, budget)
            return b
        # max(): a wall clock stepped back refills nothing rather than draining.
        b.level = min(float(budget), b.level + max(0.0, now - b.at) * budget / SPANS[name])
        b.at, b.budget = now, budget
        return b

    def _save(self) -> None:
        if self._state_file is None:
            return
        doc = {f"{t}\n{n}": [b.level, b.at, b.budget] for (t, n), b in self._buckets.items()}
        tmp = self._state_file.with_name(self._state_file.name + ".tmp")
        # A write to the page cache outlives the process; os.replace keeps the file whole.
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self._state_file)

    def _load(self, path: Path) -> None:
        try:
            doc = json.loads(path.read_text())
            for key, (level, at, budget) in doc.items():
                tenant, _, name = key.partition("\n")
                if name in SPANS:
                    self._buckets[(tenant, name)] = _Bucket(float(level), float(at), int(budget))
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, AttributeError) as e:
            # Starting from full buckets would hand every tenant a fresh budget: refuse to start.
            raise BudgetError(f"token budget state {path}: unreadable ({e})") from None

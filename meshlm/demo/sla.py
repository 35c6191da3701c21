"""The `sla` object of every demo scenario and of `python -m bench sla`: what a caller saw.

Availability counts a call as served when it ended OK or with a correct denial: the authz
filter's UNAUTHENTICATED / PERMISSION_DENIED and a tenant's own RESOURCE_EXHAUSTED are right
answers to those calls, not failures of the service (the canary gates count them the same way).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

DENIALS = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED"})


class Call(Protocol):
    status: str  # gRPC status code name, "OK" when the stream finished
    ttft_ms: float | None
    latency_ms: float


def percentile(values: Iterable[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100) of the values, rounded to 0.1; None if empty."""
    s = sorted(values)
    if not s:
        return None
    k = min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))
    return round(s[k], 1)


def latency(values: Iterable[float]) -> dict[str, float | None]:
    v = list(values)
    return {"p50": percentile(v, 50), "p99": percentile(v, 99), "p999": percentile(v, 99.9)}


def sla(calls: Iterable[Call]) -> dict[str, Any]:
    """requests, ok, availability (percent served: OK or a correct denial), TTFT and end-to-end
    latency of the OK calls (p50, p99, p999, in ms)."""
    calls = list(calls)
    ok = [c for c in calls if c.status == "OK"]
    served = len(ok) + sum(c.status in DENIALS for c in calls)
    return {
        "requests": len(calls),
        "ok": len(ok),
        "availability": round(100.0 * served / len(calls), 4) if calls else None,
        "ttft_ms": latency(c.ttft_ms for c in ok if c.ttft_ms is not None),
        "e2e_ms": latency(c.latency_ms for c in ok),
    }


def ttft(calls: Iterable[Call]) -> dict[str, float | None]:
    """TTFT p50 and p99 (ms) of the calls that ended OK."""
    lat = latency(c.ttft_ms for c in calls if c.status == "OK" and c.ttft_ms is not None)
    return {"p50": lat["p50"], "p99": lat["p99"]}


def tenant_summary(calls: Iterable[Call]) -> dict[str, Any]:
    """One tenant's calls: how many, by status, and their TTFT."""
    calls = list(calls)
    by_status: dict[str, int] = {}
    for c in calls:
        by_status[c.status] = by_status.get(c.status, 0) + 1
    return {"requests": len(calls), "by_status": by_status, "ttft_ms": ttft(calls)}

"""The built-in gates' verdict on one analysis interval: the canary's gRPC success rate from the
caller sidecars' counters (`envoy_stats`), its TTFT/TPOT p99 from its runtimes (`runtime_metrics`),
and too little traffic, which neither promotes nor fails."""

from __future__ import annotations

from typing import Any

from xds_server.mesh.rollout_spec import Gates
from xds_server.rollout.gates.envoy_stats import GrpcCounts
from xds_server.rollout.gates.runtime_metrics import LatencyReading
from xds_server.rollout.verdict import FAIL, HALT, PASS, Verdict


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1000:.0f}ms"


NOT_ENOUGH_TRAFFIC = "halted: not enough traffic"


def traffic_hint(gates: Gates, weight: int, interval: float, canary_header: str) -> str:
    """What to do about an interval that halted on too little traffic at `weight` %."""
    rate = gates.min_requests / (interval * weight / 100) if weight > 0 and interval > 0 else 0
    need = f" take about {rate:.3g} calls/s in all" if rate else " need more calls"
    return (
        f"{gates.min_requests} calls to the canary in {interval:g}s at {weight} %{need}: send "
        f"more, send test calls to the canary with the header `{canary_header}: always`, or "
        f"start the rollout again with a lower --min-requests or a higher first step "
        f"(--steps 25,50,100)"
    )


def evaluate(
    gates: Gates,
    counts: GrpcCounts | None,
    latency: LatencyReading | None,
    *,
    counts_error: str | None = None,
    latency_error: str | None = None,
) -> Verdict:
    """One interval's verdict. A source that cannot be read holds the rollout (HALT: it
    neither promotes nor fails), and so does too little traffic (Flagger's best-known trap:
    no data must neither promote nor fail) -- unless the calls seen failed so often that the
    success rate could not reach the gate even if every call still missing to `min_requests`
    succeeded: 5 calls that all failed are a failed interval, not "too little traffic"."""
    m: dict[str, Any] = {}
    if counts is None:
        return Verdict(HALT, f"halted: gRPC counts unavailable ({counts_error})", m)
    m.update(requests=counts.total, success=counts.success, failure=counts.failure)
    m["by_status"] = dict(counts.by_status)
    floor = max(counts.total, gates.min_requests)
    best_rate = 100.0 * (floor - counts.server_faults) / floor if floor else 100.0
    if counts.total < gates.min_requests or counts.total == 0:
        if best_rate < gates.grpc_success_rate_min:
            return Verdict(
                FAIL,
                f"{counts.server_faults} of {counts.total} calls to the canary failed (by "
                f"grpc-status {counts.by_status}): below min_requests {gates.min_requests}, but "
                f"the gRPC success rate can no longer reach {gates.grpc_success_rate_min:g}%",
                m,
            )
        return Verdict(
            HALT,
            f"{NOT_ENOUGH_TRAFFIC} ({counts.total} requests to the canary, "
            f"min_requests {gates.min_requests})",
            m,
        )
    rate = counts.success_rate or 0.0
    m["success_rate"] = round(rate, 3)
    failed: list[str] = []
    if rate < gates.grpc_success_rate_min:
        failed.append(
            f"gRPC success rate {rate:.2f}% < {gates.grpc_success_rate_min:g}% "
            f"({counts.server_faults} of {counts.total} failed, by grpc-status {counts.by_status})"
        )
    wants_latency = gates.ttft_p99_max is not None or gates.tpot_p99_max is not None
    if latency is not None:
        m.update(ttft_p99=latency.ttft_p99, tpot_p99=latency.tpot_p99)
        m.update(latency_samples=latency.samples, latency_over=latency.over)
        for name, value, limit in (
            ("TTFT", latency.ttft_p99, gates.ttft_p99_max),
            ("TPOT", latency.tpot_p99, gates.tpot_p99_max),
        ):
            if limit is not None and value is not None and value > limit:
                failed.append(f"{name} p99 {_ms(value)} > {_ms(limit)}")
    if failed:
        return Verdict(FAIL, "; ".join(failed), m)
    if wants_latency and latency is None:
        return Verdict(HALT, f"halted: canary runtime metrics unavailable ({latency_error})", m)
    if wants_latency and latency is not None:
        missing = [
            n
            for n, v, lim in (
                ("TTFT", latency.ttft_p99, gates.ttft_p99_max),
                ("TPOT", latency.tpot_p99, gates.tpot_p99_max),
            )
            if lim is not None and v is None
        ]
        if missing:
            return Verdict(HALT, f"halted: no {'/'.join(missing)} samples at the canary", m)
    return Verdict(
        PASS,
        f"gates passed: {counts.total} requests, success {rate:.2f}%, "
        f"TTFT p99 {_ms(latency.ttft_p99 if latency else None)}",
        m,
    )

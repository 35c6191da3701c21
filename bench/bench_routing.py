"""Routing policies side by side on one workload: round robin, least_loaded (ORCA), a session hash
(ring_hash on x-meshlm-session) and prefix_aware (Maglev with bounded load on the caller's prefix
key).

The workload is `meshlm demo --scenario shared-prefix` (meshlm/demo/scenarios/shared_prefix.py):
three int4 replicas on real processes (control plane, Envoys, model runtimes), groups of callers
sharing ~1,100-token documents, more groups than one replica's KV cache holds, offered at about
1.4x what one replica serves of uncached calls (measured at the start of each run). The arms run in
rounds, the order reversed each round, so that every arm sees the machine's load alike.

At that load every arm keeps up, so output tok/s is the offered load's. A second pair, least_loaded
and prefix_aware at SATURATED times one replica's uncached calls (more than the three replicas
serve without the cache), measures throughput where the cache decides how much gets served.
"""

from __future__ import annotations

import os
import time
from typing import Any

from bench.machine import describe
from meshlm.demo.scenarios import shared_prefix

FIGURES = (
    ("TTFT p50 ms", lambda r: r["ttft_ms"]["p50"]),
    ("TTFT p90 ms", lambda r: r["ttft_ms"]["p90"]),
    ("TTFT p99 ms", lambda r: r["ttft_ms"]["p99"]),
    ("prefix-cache hit ratio", lambda r: r["prefix_cache_hit_ratio"]),
    ("output tok/s", lambda r: r["output_tokens_per_s"]),
    ("calls OK", lambda r: r["sla"]["ok"]),
    ("availability %", lambda r: r["sla"]["availability"]),
    ("offered calls/s", lambda r: r["offered_rate_per_s"]),
    ("most replicas per group", lambda r: max(r["replicas_per_group"].values(), default=0)),
)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _mean(xs: list[Any]) -> Any:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


SATURATED = 3.0  # offered load of the second pair, in replicas' worth of uncached calls
PAIR = ("least_loaded", "prefix_aware")


def _table(arms: tuple[str, ...], runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = [
        "| figure | " + " | ".join(arms) + " | prefix_aware / least_loaded |",
        "|---|" + "---|" * (len(arms) + 1),
    ]
    for name, get in FIGURES:
        vals = {a: _mean([get(r) for r in runs[a]]) for a in arms}
        pa, ll = vals["prefix_aware"], vals["least_loaded"]
        ratio = f"{pa / ll:.2f}x" if isinstance(pa, int | float) and ll else ""
        lines.append(f"| {name} | " + " | ".join(_cell(vals[a]) for a in arms) + f" | {ratio} |")
    return lines


def main(quick: bool = False) -> str:
    rounds, seconds = (1, 25.0) if quick else (1, 75.0)
    arms = shared_prefix.ALL_ARMS
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    saturated: dict[str, list[dict[str, Any]]] = {a: [] for a in PAIR}
    loads: list[str] = []
    t0 = time.monotonic()
    for i in range(rounds):
        for arm in arms if i % 2 == 0 else arms[::-1]:
            runs[arm].append(shared_prefix._run(arm, seconds=seconds, workdir=None, say=print))
            loads.append(f"{os.getloadavg()[0]:.2f}")
        for arm in PAIR if i % 2 == 0 else PAIR[::-1]:
            run = shared_prefix._run(arm, seconds=seconds, workdir=None, say=print,
                                     demand=SATURATED)  # fmt: skip
            saturated[arm].append(run)
            loads.append(f"{os.getloadavg()[0]:.2f}")
    command = f"python -m bench routing{' --quick' if quick else ''}"
    lines = [
        "## Routing policies on shared prompt prefixes (`python -m bench routing`)",
        "",
        f"Machine: {describe()}. Command: `{command}`: {rounds} round(s) of the four arms, then "
        f"of the saturated pair, {seconds:.0f} s of traffic each after one warm-up round of the "
        f"{shared_prefix.GROUPS} groups; the 1-minute load average after each run: "
        f"{', '.join(loads)}. Workload: `meshlm demo --scenario shared-prefix` "
        f"({shared_prefix.GROUPS} groups of {shared_prefix.QUESTIONS} callers, ~1,100-token "
        f"shared documents, 3 int4 replicas, {shared_prefix.DEMAND:g}x one replica's "
        "uncached-call rate). Peer: round robin, least_loaded and the session hash are what the "
        "mesh routed by before prefix_aware; the issue's goal for prefix_aware against "
        "least_loaded is TTFT p90 <= 0.5x, hit ratio >= 0.8, output tok/s >= 1.3x.",
        "",
        *_table(arms, runs),
        "",
        f"At saturation: the same workload offered at {SATURATED:g}x one replica's uncached-call "
        "rate (more than the three replicas serve without the cache), least_loaded and "
        "prefix_aware:",
        "",
        *_table(PAIR, saturated),
    ]
    lines += ["", f"({time.monotonic() - t0:.0f} s in all)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())

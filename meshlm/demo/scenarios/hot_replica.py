"""`meshlm demo --scenario hot-replica`: one replica of two decodes at half speed.

Two int4 replicas of v1, each behind its inbound sidecar, the caller-side sidecar, and one tenant's
open-loop Generate traffic. Replica v1-1 runs with `--fault-slow-decode 2`. With `load_balancing:
least_loaded` the caller's Envoy weighs the replicas by their ORCA out-of-band reports (the slow one
holds each stream longer, so at the same rps its time-averaged utilization is higher and it gets
fewer calls, model_runtime/serving/orca.py); with `round_robin` each gets half. The report adds
`share_by_replica` (Generate calls each runtime answered, from its own /metrics.json totals) and the
`sla` object (meshlm/demo/sla.py)."""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from typing import Any

from meshlm.demo.scenario import report_of, running, say, write_report

BENCH_TITLE = "Load-aware routing: one replica of two decodes at half speed"
SLOW, FAST = "v1-1", "v1-0"
SLOW_FACTOR = "2"
RATE = 1.2  # calls per second in all: the slow replica overloads under round robin
MAX_NEW_TOKENS = 16
WARMUP_CALLS = 6


def run(args: argparse.Namespace, name: str) -> int:
    report = report_of(
        "hot-replica: one replica of two decodes at half speed",
        lambda: _run(least_loaded=True, seconds=60.0, workdir=args.workdir, say=say),
    )
    if report is None:
        return 1
    share = report["share_by_replica"].get(SLOW)
    return 0 if share is not None and share < 0.5 and report["sla"]["ok"] else 1


def measure(mechanism: bool, quick: bool) -> dict[str, Any]:
    # 130 s at RATE is about 156 calls, so p99 is not just the slowest call
    r = _run(least_loaded=mechanism, seconds=30.0 if quick else 130.0, workdir=None,
             say=lambda m: None)  # fmt: skip
    return {"sla": r["sla"], "slow_replica_share": r["share_by_replica"].get(SLOW)}


def _mesh(least_loaded: bool) -> dict[str, Any]:
    from meshlm.demo.launcher import SERVICE, scenario_mesh

    mesh = scenario_mesh({"v1": 100})
    mesh["services"][SERVICE]["load_balancing"] = "least_loaded" if least_loaded else "round_robin"
    return mesh


def _run(*, least_loaded: bool, seconds: float, workdir: Any, say: Any) -> dict[str, Any]:
    from meshlm.demo.launcher import SERVICE, LocalMesh
    from meshlm.demo.sla import sla
    from meshlm.demo.traffic import TenantLoad, Traffic

    lb = "least_loaded" if least_loaded else "round_robin"
    faults = {SLOW: ["--fault-slow-decode", SLOW_FACTOR]}
    mesh = LocalMesh(_mesh(least_loaded), workdir=workdir, replicas={"v1": 2}, faults=faults)
    say(f"logs and report in {mesh.workdir}; load_balancing {lb}; {SLOW} decodes "
        f"{SLOW_FACTOR}x slower")  # fmt: skip
    with running(mesh, say) as stops:
        _warm_up(mesh, say)
        before = _generated(mesh)
        load = TenantLoad("acme", "demo-acme-key", rate=RATE)
        traffic = Traffic(
            mesh.caller_target, [load], authority=SERVICE, max_new_tokens=MAX_NEW_TOKENS
        ).start()
        stops.callback(traffic.stop)
        say(f"traffic: acme {RATE:g} Generate calls/s, {MAX_NEW_TOKENS} tokens, {seconds:.0f} s")
        time.sleep(seconds)
        traffic.stop()
        time.sleep(0.5)  # a runtime counts a stream once its trailers are out
        after = _generated(mesh)
        served = {n: after[n] - before[n] for n in after}
        total = sum(served.values())
        report = {
            "scenario": "hot-replica",
            "load_balancing": lb,
            "workdir": str(mesh.workdir),
            "slow_replica": {"name": SLOW, "slow_decode": float(SLOW_FACTOR)},
            "offered_rate_per_s": RATE,
            "max_new_tokens": MAX_NEW_TOKENS,
            "seconds": seconds,
            "sla": sla(traffic.outcomes),
            "served_by_replica": served,
            "share_by_replica": {n: round(c / total, 3) for n, c in served.items()}
            if total
            else {},
            "orca_reports_received": _orca_reports(mesh),
        }
        write_report(mesh.workdir, report)
        return report


def _warm_up(mesh: Any, say: Any) -> None:
    """A few calls through the mesh (first-call costs out of the figures), then past Envoy's
    blackout period, so least_loaded starts with weights from real reports."""
    from meshlm.demo.launcher import SERVICE
    from meshlm.demo.traffic import TenantLoad, Traffic
    from xds_server.resources.clusters import BLACKOUT_PERIOD

    warm = Traffic(mesh.caller_target, [TenantLoad("acme", "demo-acme-key", rate=2.0)],
                   authority=SERVICE, max_new_tokens=4).start()  # fmt: skip
    time.sleep(WARMUP_CALLS / 2.0)
    warm.stop()
    time.sleep(BLACKOUT_PERIOD)
    say(f"warmed up: {sum(o.status == 'OK' for o in warm.outcomes)} calls")


def _generated(mesh: Any) -> dict[str, int]:
    """Generate calls each runtime answered OK so far (its /metrics.json totals)."""
    out = {}
    for name, rt in mesh.runtimes.items():
        url = f"http://127.0.0.1:{rt.metrics_port}/metrics.json"
        with urllib.request.urlopen(url, timeout=5) as r:
            totals = json.loads(r.read()).get("totals", {})
        out[name] = int(totals.get("Generate", {}).get("OK", 0))
    return out


def _orca_reports(mesh: Any) -> int:
    stats = mesh.envoy_stats(mesh.caller_admin, "lb_orca_oob.reports_received")
    return sum(stats.values())

"""`meshlm demo --scenario hot-replica`: one replica of two decodes at half speed.

Two int4 replicas of v1 (MAX_BATCH slots each), each behind its inbound sidecar, the caller-side
sidecar, and one tenant's open-loop Generate traffic: stories that run to MAX_NEW_TOKENS, so
decoding is most of a call. Replica v1-1 runs with `--fault-slow-decode 2`. The offered rate is
scaled to this machine: both replicas' speeds are measured first, at once (straight to their
runtimes, their slots full), and the tenant offers LOAD times what the slow replica serves at
half of the calls, so round robin overloads it (its queue grows for the whole run) while both
together have room.
With `load_balancing: least_loaded` the caller's Envoy weighs the replicas by their ORCA
out-of-band reports (the slow one holds each stream longer, so at the same rps its time-averaged
utilization is higher and it gets fewer calls, model_runtime/serving/orca.py); with
`round_robin` each gets half. With `prefix_aware` every call has its own prefix key (no two
prompts share a first KV block), so the hash spreads them evenly and the bounded load
(`hash_balance_factor`: a replica holding more than its share of the calls in flight is passed
over) is what moves calls off the slow replica, whose queue holds them longer. The report adds
`share_by_replica` (Generate calls each runtime answered, from its own /metrics.json totals) and
the `sla` object (meshlm/demo/sla.py); the demo runs the three arms, round robin first."""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from meshlm.demo.scenario import report_of, running, say, write_report

BENCH_TITLE = "Load-aware routing: one replica of two decodes at half speed"
SLOW, FAST = "v1-1", "v1-0"
SLOW_FACTOR = "2"
MAX_BATCH = 2
# the tenant may run as many streams as a replica has slots (its default is 3/4 of them)
SERVE_ARGS = ["--max-batch", str(MAX_BATCH), "--tenant-max-streams", str(MAX_BATCH)]
MAX_NEW_TOKENS = 128
# Offered: LOAD times what the slow replica serves (measured with both replicas busy) at round
# robin's half of the calls, so its queue grows all run; it keeps up at a share of at most
# 1 / (2 LOAD), and the fast replica, serving about SLOW_FACTOR times as much, takes the rest.
LOAD = 1.3
RATE_BOUNDS = (0.2, 3.0)  # calls per second, whatever the measurement says
WARMUP_CALLS = 6
SHARE_GOAL = 0.4  # the slow replica's share with least_loaded and with prefix_aware
# round robin is the baseline; prefix_aware must keep least_loaded's gain on calls that share
# no prefix, where its hash alone would split them evenly
ARMS = ("round_robin", "least_loaded", "prefix_aware")
# Every call's prompt is its own from its first KV block on (the number leads), and longer
# than one block, so prefix_aware has a key for each call and no two share one: no cache to win.
PROMPTS = tuple(
    f"Story number {n}: write a long story about {topic}, with a beginning, a middle and an end."
    for n, topic in enumerate(
        t for _ in range(100) for t in ("a dragon", "the sea", "a robot", "a city")
    )
)


def run(args: argparse.Namespace, name: str) -> int:
    shares = {}
    for lb in ARMS:
        workdir = None if args.workdir is None else Path(args.workdir) / lb
        if workdir is not None:
            workdir.mkdir(exist_ok=True)
        report = report_of(
            f"hot-replica ({lb}): one replica of two decodes at half speed",
            lambda lb=lb, w=workdir: _run(load_balancing=lb, seconds=60.0, workdir=w, say=say),
        )
        if report is None or not report["sla"]["ok"]:
            return 1
        shares[lb] = report["share_by_replica"].get(SLOW)
    print(f"{SLOW}'s share of the calls: "
          + ", ".join(f"{lb} {shares[lb]}" for lb in ARMS)
          + f" (goal <= {SHARE_GOAL} for {' and '.join(ARMS[1:])})")  # fmt: skip
    return 0 if all(shares[lb] is not None and shares[lb] <= SHARE_GOAL for lb in ARMS[1:]) else 1


def offered_rate(slow_tokens_per_s: float) -> float:
    """Calls per second that ask LOAD times what the slow replica serves (`slow_tokens_per_s`,
    measured) at round robin's half of the calls, within RATE_BOUNDS."""
    rate = 2 * LOAD * slow_tokens_per_s / MAX_NEW_TOKENS
    return round(min(max(rate, RATE_BOUNDS[0]), RATE_BOUNDS[1]), 2)


def measure(mechanism: bool, quick: bool) -> dict[str, Any]:
    # 130 s, so p99 is not just the slowest call
    lb = "least_loaded" if mechanism else "round_robin"
    r = _run(load_balancing=lb, seconds=30.0 if quick else 130.0, workdir=None,
             say=lambda m: None)  # fmt: skip
    return {
        "sla": r["sla"],
        "offered_rate_per_s": r["offered_rate_per_s"],
        "slow_replica_share": r["share_by_replica"].get(SLOW),
    }


def _mesh(load_balancing: str) -> dict[str, Any]:
    from meshlm.demo.launcher import SERVICE, scenario_mesh

    mesh = scenario_mesh({"v1": 100})
    mesh["services"][SERVICE]["load_balancing"] = load_balancing
    return mesh


def _run(*, load_balancing: str, seconds: float, workdir: Any, say: Any) -> dict[str, Any]:
    from meshlm.demo.launcher import SERVICE, LocalMesh
    from meshlm.demo.sla import sla
    from meshlm.demo.traffic import TenantLoad, Traffic

    lb = load_balancing
    faults = {SLOW: [*SERVE_ARGS, "--fault-slow-decode", SLOW_FACTOR], FAST: SERVE_ARGS}
    mesh = LocalMesh(_mesh(lb), workdir=workdir, replicas={"v1": 2}, faults=faults)
    say(f"logs and report in {mesh.workdir}; load_balancing {lb}; {SLOW} decodes "
        f"{SLOW_FACTOR}x slower")  # fmt: skip
    with running(mesh, say) as stops:
        speed = _speeds(mesh)
        rate = offered_rate(speed[SLOW])
        say(f"{SLOW} serves {speed[SLOW]:.0f} tokens/s, {FAST} {speed[FAST]:.0f} (in "
            f"{MAX_BATCH} slots each, both at once): acme offers {rate:g} calls/s")  # fmt: skip
        _warm_up(mesh, say)
        before = _generated(mesh)
        load = TenantLoad("acme", "demo-acme-key", rate=rate, prompts=PROMPTS)
        traffic = Traffic(
            mesh.caller_target, [load], authority=SERVICE, max_new_tokens=MAX_NEW_TOKENS
        ).start()
        stops.callback(traffic.stop)
        say(f"traffic: acme {rate:g} Generate calls/s, {MAX_NEW_TOKENS} tokens, {seconds:.0f} s")
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
            "tokens_per_s_by_replica": {n: round(v, 1) for n, v in speed.items()},
            "offered_rate_per_s": rate,
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


def _speeds(mesh: Any) -> dict[str, float]:
    """Tokens/s each replica serves with its slots full, both measured at once (straight to
    the runtimes): they share this machine's cores, so one measured alone is faster than it
    is under the scenario's load."""
    from concurrent.futures import ThreadPoolExecutor

    from meshlm.demo.scenarios.capacity import decode_capacity

    def speed(name: str) -> float:
        target = f"127.0.0.1:{mesh.runtimes[name].port}"
        return decode_capacity(target, MAX_BATCH, tokens=MAX_NEW_TOKENS)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip((SLOW, FAST), pool.map(speed, (SLOW, FAST)), strict=True))


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

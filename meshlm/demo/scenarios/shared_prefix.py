"""`meshlm demo --scenario shared-prefix`: callers in groups, each group sharing a long prompt
prefix (a document of 1,100 words, over a thousand tokens, then a short question of its own).

Three int4 replicas of v1, each behind its inbound sidecar, and the caller-side sidecar. Two arms
on the same workload, one mesh each: `load_balancing: prefix_aware` (the caller's class filter
hashes each prompt's leading blocks, Envoy's Maglev sends a prefix to one replica while its load
is within bound) and `least_loaded` (ORCA load alone). There are more groups than one replica's
KV cache holds, so a replica that sees every group keeps evicting them; a replica that sees only
its share of the groups keeps them. The offered rate is set from the mesh's own speed: about 1.4
times what one replica serves of calls whose prefix is not cached (measured at the start of each
arm). The first round of the groups warms the caches and is not counted. The report gives, per
arm, TTFT p50/p90/p99, the prefix-cache hit ratio (the runtimes'
meshlm_prefix_cache_hits / meshlm_prefix_cache_queries, from their /metrics.json), output
tokens per second (until the last counted call finished) and how many replicas served each
group."""

from __future__ import annotations

import argparse
import json
import random
import time
import urllib.request
from typing import Any

from meshlm.demo.scenario import report_of, running, say, write_report

BENCH_TITLE = "Cache-aware routing: groups of callers sharing long prompt prefixes"
# Prime to the replica count: round robin over the groups in turn would otherwise send each group
# to one replica every time (12 groups over 3 replicas: group g always to replica g % 3).
GROUPS = 13
DOC_WORDS = 1100
QUESTIONS = 8
MAX_NEW_TOKENS = 16
DEMAND = 1.4  # offered load, in replicas' worth of uncached calls
CALIBRATION_CALLS = 2
ARMS = ("prefix_aware", "least_loaded")
# The routing comparison (bench/bench_routing.py): every arm on the same workload. session_hash is
# ring_hash on x-meshlm-session, each caller (a group's question) its own session.
ALL_ARMS = ("round_robin", "least_loaded", "session_hash", "prefix_aware")

_WORDS = [
    "river",
    "mountain",
    "ledger",
    "invoice",
    "shipment",
    "harbor",
    "engine",
    "quarterly",
    "forecast",
    "margin",
    "supplier",
    "contract",
    "warranty",
    "customer",
    "region",
    "battery",
    "sensor",
    "firmware",
    "audit",
    "policy",
    "schedule",
    "budget",
    "freight",
    "customs",
    "tariff",
    "pallet",
    "warehouse",
    "inventory",
    "return",
    "refund",
    "discount",
    "premium",
    "annual",
    "report",
    "board",
    "meeting",
    "minutes",
    "agenda",
    "proposal",
    "vendor",
    "catalogue",
    "order",
    "delivery",
    "delay",
    "route",
]


def document(group: int, words: int = DOC_WORDS, salt: str = "") -> str:
    """A deterministic pseudo-document: the group's long shared prefix."""
    rng = random.Random(f"shared-prefix-{group}{salt}")
    body = " ".join(rng.choice(_WORDS) for _ in range(words))
    return f"Document {group}{salt}. Read it, then answer the question after it.\n\n{body}\n\n"


def prompts(group: int) -> tuple[str, ...]:
    doc = document(group)
    return tuple(f"{doc}Question {q}: which word comes up most often?" for q in range(QUESTIONS))


def interleaved() -> tuple[str, ...]:
    """Every group's prompts, the groups taking turns: g0 q0, g1 q0, ..., g0 q1, ..."""
    per_group = [prompts(g) for g in range(GROUPS)]
    return tuple(p[q] for q in range(QUESTIONS) for p in per_group)


def sessions() -> tuple[str, ...]:
    """The caller (session) of each call of `interleaved()`: one per group and question."""
    return tuple(f"g{g}-q{q}" for q in range(QUESTIONS) for g in range(GROUPS))


def run(args: argparse.Namespace, name: str) -> int:
    report = report_of(
        "shared-prefix: groups of callers sharing long prompt prefixes",
        lambda: _both(seconds=60.0, workdir=args.workdir, say=say),
    )
    if report is None:
        return 1
    arms = report["arms"]
    return 0 if all(a["sla"]["ok"] > 0 for a in arms.values()) else 1


def measure(mechanism: bool, quick: bool) -> dict[str, Any]:
    arm = ARMS[0] if mechanism else ARMS[1]
    r = _run(arm, seconds=30.0 if quick else 120.0, workdir=None, say=lambda m: None)
    return {k: r[k] for k in ("sla", "ttft_ms", "prefix_cache_hit_ratio", "output_tokens_per_s")}


def _both(*, seconds: float, workdir: Any, say: Any) -> dict[str, Any]:
    from pathlib import Path

    base = Path(workdir) if workdir else None
    arms = {}
    for arm in ARMS:
        sub = None if base is None else base / arm
        if sub is not None:
            sub.mkdir(parents=True, exist_ok=True)
        arms[arm] = _run(arm, seconds=seconds, workdir=sub, say=say)
    report = {"scenario": "shared-prefix", "workdir": str(base or arms[ARMS[0]]["workdir"]),
              "arms": arms}  # fmt: skip
    if base is not None:
        write_report(base, report)
    return report


def _mesh(arm: str) -> dict[str, Any]:
    from meshlm.demo.launcher import SERVICE, scenario_mesh
    from meshlm.demo.traffic import SESSION_HEADER

    mesh = scenario_mesh({"v1": 100})
    svc = mesh["services"][SERVICE]
    if arm == "session_hash":
        svc["load_balancing"] = "ring_hash"
        svc["route"]["hash_policy"] = {"header": SESSION_HEADER}
    else:
        svc["load_balancing"] = arm
    return mesh


def _run(
    arm: str, *, seconds: float, workdir: Any, say: Any, demand: float = DEMAND
) -> dict[str, Any]:
    """One arm's run; `demand`: the offered load in replicas' worth of uncached calls."""
    from meshlm.demo.launcher import SERVICE, LocalMesh
    from meshlm.demo.sla import percentile, sla
    from meshlm.demo.traffic import TenantLoad, Traffic

    mesh = LocalMesh(_mesh(arm), workdir=workdir, replicas={"v1": 3})
    say(f"logs and report in {mesh.workdir}; load_balancing {arm}")
    with running(mesh, say) as stops:
        cold_s = _calibrate(mesh)
        rate = demand / cold_s
        say(f"an uncached call takes {cold_s:.2f} s: offering {rate:.2f} calls/s")
        # One open loop over the groups in turn (evenly spaced: no group's calls come in a burst).
        # The first round (each group once, cold everywhere) warms the caches and is not counted.
        loads = [TenantLoad("acme", "demo-acme-key", rate=rate, prompts=interleaved(),
                            sessions=sessions())]  # fmt: skip
        traffic = Traffic(
            mesh.caller_target, loads, authority=SERVICE, max_new_tokens=MAX_NEW_TOKENS
        ).start()
        stops.callback(traffic.stop)
        say(f"traffic: {GROUPS} groups, {rate:.2f} calls/s in all, {seconds:.0f} s after a round")
        time.sleep(GROUPS / rate)
        before = _cache(mesh)
        t0 = time.monotonic()
        time.sleep(seconds)
        traffic.stop()
        elapsed = time.monotonic() - t0
        time.sleep(0.5)
        after = _cache(mesh)
        hits = sum(after[n][0] - before[n][0] for n in after)
        queries = sum(after[n][1] - before[n][1] for n in after)
        counted = [o for o in traffic.outcomes if o.at >= t0 - 0.5 / rate]
        ok = [o for o in counted if o.status == "OK"]
        ttft = [o.ttft_ms for o in ok if o.ttft_ms is not None]
        served_s = max([elapsed, *(o.at + o.latency_ms / 1000 - t0 for o in ok)])
        groups: dict[str, set[str]] = {}
        for o in traffic.outcomes:
            if o.status == "OK":
                groups.setdefault(o.prompt.partition(".")[0], set()).add(o.replica)
        report = {
            "scenario": "shared-prefix",
            "load_balancing": arm,
            "workdir": str(mesh.workdir),
            "groups": GROUPS,
            "uncached_call_s": round(cold_s, 3),
            "offered_rate_per_s": round(rate, 3),
            "seconds": seconds,
            "sla": sla(counted),
            "ttft_ms": {f"p{q}": percentile(ttft, q) for q in (50, 90, 99)},
            "prefix_cache_hit_ratio": round(hits / queries, 3) if queries else None,
            # over the time until the last counted call finished: a mesh that falls behind the
            # offered rate serves the same tokens over a longer time
            "output_tokens_per_s": round(sum(len(o.token_ids) for o in ok) / served_s, 2),
            "served_by_replica": {n: after[n][2] - before[n][2] for n in after},
            # per group, how many replicas served its calls (the warm-up round's too)
            "replicas_per_group": {g: len(r) for g, r in sorted(groups.items())},
        }
        write_report(mesh.workdir, report)
        return report


def _calibrate(mesh: Any) -> float:
    """Seconds one call takes whose prefix no replica holds (after one warm-up call)."""
    from meshlm.demo.launcher import SERVICE
    from meshlm.demo.traffic import TenantLoad, Traffic

    def once(salt: str) -> float:
        prompt = f"{document(0, salt=salt)}Question: which word comes up most often?"
        one = Traffic(mesh.caller_target, [TenantLoad("calibrate", "demo-acme-key", rate=0.01,
                      prompts=(prompt,))], authority=SERVICE,
                      max_new_tokens=MAX_NEW_TOKENS).start()  # fmt: skip
        deadline = time.monotonic() + 120
        while not one.outcomes and time.monotonic() < deadline:
            time.sleep(0.05)
        one.stop()
        if not one.outcomes or one.outcomes[0].status != "OK":
            raise RuntimeError(f"calibration call failed: {one.outcomes[:1]}")
        return one.outcomes[0].latency_ms / 1000

    once("-warm-up")
    return sum(once(f"-calibrate-{i}") for i in range(CALIBRATION_CALLS)) / CALIBRATION_CALLS


def _cache(mesh: Any) -> dict[str, tuple[int, int, int]]:
    """Per runtime: prefix-cache hit and query tokens, and Generate calls answered, so far."""
    out = {}
    for name, rt in mesh.runtimes.items():
        url = f"http://127.0.0.1:{rt.metrics_port}/metrics.json"
        with urllib.request.urlopen(url, timeout=5) as r:
            m = json.loads(r.read())
        engine = m.get("engine", {})
        served = int(m.get("totals", {}).get("Generate", {}).get("OK", 0))
        out[name] = (
            int(engine.get("prefix_hit_tokens", 0)),
            int(engine.get("prefix_query_tokens", 0)),
            served,
        )
    return out

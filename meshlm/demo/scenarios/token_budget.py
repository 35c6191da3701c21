"""`meshlm demo --scenario token-budget`: a tenant floods long generations; its token budget holds.

One int4 runtime behind its inbound sidecar (Wasm authz verifies the key and hands the runtime the
tenant's `x-meshlm-token-budget`; the runtime reserves prompt + max_tokens per call and refunds
what a stream did not use). The quiet tenant sends short calls throughout; the noisy one floods
long generations at twice what the runtime decodes (measured first, so the load fits the CPU).
With the mechanism on, the noisy tenant has a `token_budget` of a quarter of that capacity per
minute; off, none. The report gives, per tenant, TTFT p50/p99 and calls by status, and:

- `noisy_billed_tokens`: its prompt + streamed tokens in the flood phase, from the runtime's own
  usage counters (`meshlm_tenant_prompt_tokens_total`, `..._generation_tokens_total`);
- `noisy_allowed_tokens`: the most the budget admits in that time (a full bucket, then the refill);
- `budget_overshoot_pct`: how far the billed tokens passed the allowed ones (goal 0);
- `quiet_ttft_p99_ratio`: the quiet tenant's TTFT p99 beside the flood over its p99 alone, in the
  same run (goal <= 1.2 with the budget).
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from meshlm.demo.scenario import report_of, running, say, write_report
from meshlm.demo.scenarios.capacity import STORY_PROMPTS, decode_capacity, flood_tokens

BENCH_TITLE = "Token budgets: a tenant floods long generations beside a quiet one"
SERVE_ARGS = ["--max-batch", "8", "--max-queue", "16"]
QUIET_RATE, QUIET_TOKENS = 1.0, 4
NOISY_RATE, FLOOD_LOAD, NOISY_TOKENS_RANGE = 3.0, 2.0, (48, 256)
BUDGET_SHARE = 0.25  # of the runtime's measured decode capacity, per minute
OVERSHOOT_GOAL_PCT, RATIO_GOAL = 0.0, 1.2
# seconds: the quiet tenant alone, beside the flood (the two minutes in full)
PHASES = {"full": (30.0, 120.0), "quick": (15.0, 40.0), "smoke": (6.0, 12.0)}
KEYS = {"quiet": "demo-quiet-key", "noisy": "demo-noisy-key"}
VERSION = "v1"


def run(args: argparse.Namespace, name: str) -> int:
    report = report_of(
        "token-budget: a tenant floods long generations; its token budget holds",
        lambda: measure_run(True, "full", workdir=args.workdir, say=say),
    )
    if report is None:
        return 1
    over, ratio = report["budget_overshoot_pct"], report["quiet_ttft_p99_ratio"]
    print(f"budget overshoot {over} % (goal {OVERSHOOT_GOAL_PCT:g} %), quiet TTFT p99 beside "
          f"the flood / alone {ratio} (goal <= {RATIO_GOAL})")  # fmt: skip
    return 0 if over == 0 else 1


def measure(mechanism: bool, quick: bool) -> dict[str, Any]:
    r = measure_run(mechanism, "quick" if quick else "full", workdir=None, say=lambda m: None)
    keys = ("budget_overshoot_pct", "quiet_ttft_p99_ratio", "tenants", "sla")
    return {k: r[k] for k in keys}


def measure_run(mechanism: bool, phases: str, workdir: Path | None, say: Any) -> dict[str, Any]:
    """One mesh, the noisy tenant with a token budget (`mechanism`) or without."""
    from meshlm.demo.launcher import LocalMesh, scenario_mesh

    mesh = LocalMesh(_mesh_doc(scenario_mesh({VERSION: 100}), None), workdir=workdir,
                     faults={VERSION: SERVE_ARGS})  # fmt: skip
    say(f"logs and report in {mesh.workdir}; token budget {'on' if mechanism else 'off'}")
    with running(mesh, say):
        rt = mesh.runtimes[VERSION]
        capacity = decode_capacity(f"127.0.0.1:{rt.port}", slots=8)
        tokens = flood_tokens(capacity, NOISY_RATE, FLOOD_LOAD, NOISY_TOKENS_RANGE)
        per_minute = round(BUDGET_SHARE * capacity * 60)
        say(f"the runtime decodes {capacity:.0f} tokens/s in 8 slots: the flood asks {tokens} a "
            f"call, {NOISY_RATE:g} calls/s; budget {per_minute} tokens/minute")  # fmt: skip
        if mechanism:
            doc = _mesh_doc(mesh.mesh, {"tokens_per_minute": per_minute})
            mesh.admin("POST", "/v1/mesh?timeout=10", doc)  # ACKed by every sidecar
        r = _phases(mesh, tokens, PHASES[phases], say)
    allowed = per_minute + per_minute * r.pop("flood_s") / 60
    billed = r["noisy_billed_tokens"]
    report = {
        "scenario": "token-budget",
        "workdir": str(mesh.workdir),
        "token_budget": {"tokens_per_minute": per_minute} if mechanism else None,
        "traffic": {
            "quiet": {"rate_per_s": QUIET_RATE, "max_new_tokens": QUIET_TOKENS},
            "noisy": {"rate_per_s": NOISY_RATE, "max_new_tokens": tokens},
            "decode_capacity_tokens_per_s": round(capacity),
        },
        "noisy_allowed_tokens": round(allowed),
        "budget_overshoot_pct": round(max(0.0, billed - allowed) / allowed * 100, 2),
        **r,
    }
    write_report(mesh.workdir, report)
    return report


def _mesh_doc(base: dict[str, Any], budget: dict[str, int] | None) -> dict[str, Any]:
    from meshlm.demo.launcher import SERVICE
    from wasm_filters.policy import hash_key

    doc = json.loads(json.dumps(base))
    doc["tenants"] = {
        name: {"key_sha256": hash_key(key), "allow": [f"{SERVICE}/Generate"], "priority": "normal"}
        for name, key in KEYS.items()
    }
    if budget is not None:
        doc["tenants"]["noisy"]["token_budget"] = budget
    return doc


def _traffic(target: str, tenant: str, rate: float, tokens: int, prompts: Any = None) -> Any:
    from meshlm.demo.traffic import tenant_traffic

    return tenant_traffic(target, tenant, KEYS[tenant], rate, tokens, prompts)


def _billed(metrics_url: str, tenant: str) -> float:
    """Prompt + streamed tokens the runtime counted for `tenant` (its usage counters)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name in ("meshlm_tenant_prompt_tokens", "meshlm_tenant_generation_tokens"):
            total += sum(
                s.value
                for s in fam.samples
                if s.name.endswith("_total") and s.labels.get("tenant") == tenant
            )
    return total


def _phases(mesh: Any, noisy_tokens: int, durations: tuple[float, float], say: Any) -> dict:
    """Through the runtime's inbound sidecar: warm-up, the quiet tenant alone, then beside the
    flood; the noisy tenant's billed tokens counted over the flood."""
    from meshlm.demo.sla import sla, tenant_summary, ttft

    alone_s, flood_s = durations
    rt = mesh.runtimes[VERSION]
    target = f"127.0.0.1:{rt.inbound_port}"
    metrics = f"http://127.0.0.1:{rt.metrics_port}/metrics"
    warm = _traffic(target, "quiet", 2.0, QUIET_TOKENS).start()
    time.sleep(2.0)
    warm.stop()
    quiet = _traffic(target, "quiet", QUIET_RATE, QUIET_TOKENS).start()
    t_alone = time.monotonic()
    time.sleep(alone_s)
    before = _billed(metrics, "noisy")
    noisy = _traffic(target, "noisy", NOISY_RATE, noisy_tokens, STORY_PROMPTS).start()
    t_flood = time.monotonic()
    say(f"quiet alone {alone_s:.0f} s, now beside the flood for {flood_s:.0f} s")
    time.sleep(flood_s)
    noisy.stop()
    quiet.stop()
    spent = time.monotonic() - t_flood  # the stop waits for calls in flight: they count too
    billed = _billed(metrics, "noisy") - before
    alone = [o for o in quiet.outcomes if t_alone <= o.at < t_flood]
    beside = [o for o in quiet.outcomes if o.at >= t_flood]

    alone_p99, beside_p99 = ttft(alone)["p99"], ttft(beside)["p99"]
    ratio = round(beside_p99 / alone_p99, 3) if alone_p99 and beside_p99 else None
    say(f"quiet TTFT p99 alone {alone_p99} ms, beside the flood {beside_p99} ms")
    return {
        "flood_s": spent,
        "quiet_alone": tenant_summary(alone),
        "tenants": {"quiet": tenant_summary(beside), "noisy": tenant_summary(noisy.outcomes)},
        "quiet_ttft_p99_ratio": ratio,
        "noisy_billed_tokens": round(billed),
        "sla": sla([*beside, *noisy.outcomes]),
    }

"""The canary scenarios (the default `meshlm demo`): two versions of the same real model (v1 bf16
stable, v2 int4 canary) each behind its sidecar, a caller-side sidecar, tenants sending real gRPC
generate calls (one rate-limited, one unauthorised), and an SLO-gated rollout of v2 from 0 to
100 %. `faulty-canary` injects errors and +1.5 s TTFT into v2: the gates fail and it rolls back."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

TERMINAL = ("Succeeded", "RolledBack", "Failed")


def run(args: argparse.Namespace, name: str) -> int:
    from meshlm.demo.launcher import SERVICE, LocalMesh
    from meshlm.demo.report import (
        gates_beside_client,
        identity_report,
        render,
        sidecar_denials,
    )
    from meshlm.demo.scenarios.bad_model import SERVE_ARGS, quality_per_step
    from meshlm.demo.traffic import TenantLoad, Traffic, summarize, write_calls

    faulty, bad = name == "faulty-canary", name == "bad-model"
    faults = {"v2": ["--fault-error-percent", "10", "--fault-delay-ms", "1500"]}
    if bad:  # fast and healthy, answers wrong: the quality gate's case
        faults = SERVE_ARGS
    mesh = LocalMesh(workdir=args.workdir, faults=faults if faulty or bad else None)
    print(f"meshlm demo: logs and report in {mesh.workdir}", flush=True)
    loads = [
        TenantLoad("acme", "demo-acme-key", rate=2.0),
        # A third of acme's calls: the OpenAI HTTP API with the openai SDK.
        TenantLoad("acme", "demo-acme-key", rate=1.0, api="openai"),
        TenantLoad("free", "demo-free-key", rate=1.0),  # over its 1 per 2 s bucket: 429s
        TenantLoad("free", "demo-free-key", rate=0.2, method="Info"),  # not allowed: 403
        TenantLoad("intruder", "not-a-key", rate=0.3),  # unknown key: 401
    ]
    traffic = None
    try:
        mesh.start(say=lambda m: print(f"  {m}", flush=True))
        traffic = Traffic(mesh.caller_target, loads, authority=SERVICE).start()
        print(
            "traffic: acme 3/s (1/s of it with the openai SDK), free 1.2/s (rate-limited), "
            "intruder 0.3/s (bad key)"
        )
        time.sleep(5)
        status = mesh.admin("POST", f"/rollouts/{SERVICE}", {})
        print(
            f"rollout of {SERVICE}: {status['spec']['stable']} -> {status['spec']['canary']}, "
            f"steps {status['spec']['steps']}, gates {status['spec']['gates']}"
        )
        status = _follow(mesh, SERVICE, deadline=time.monotonic() + args.timeout)
        traffic.stop()
        versions = mesh.replica_versions()
        clock = time.time() - time.monotonic()
        report = {
            "rollout": status,
            "traffic": summarize(traffic.outcomes, versions),
            "steps": gates_beside_client(status, traffic.outcomes, versions, clock),
            "denials_at_sidecars": sidecar_denials(mesh),
            "identity": identity_report(mesh),
            "faulty_canary": faulty,
        }
        if status["spec"].get("quality"):  # the demo mesh's mirror-mode quality gate
            report["quality_per_step"] = quality_per_step(status)
        (mesh.workdir / "report.json").write_text(json.dumps(report, indent=2))
        write_calls(mesh.workdir / "calls.jsonl", traffic.outcomes, versions)
        print(render(report))
        print(f"JSON report: {mesh.workdir / 'report.json'}")
        expected = "RolledBack" if faulty or bad else "Succeeded"
        return 0 if status["state"] == expected else 1
    except (TimeoutError, RuntimeError, OSError) as e:
        print(f"meshlm demo: {e}", file=sys.stderr)
        return 1
    finally:
        if traffic is not None:
            traffic.stop()
        mesh.stop()
        print("all processes stopped")


def _follow(mesh: Any, service: str, deadline: float) -> dict[str, Any]:
    """Print each transition and each interval's analysis as the rollout goes."""
    seen_history = seen_analyses = 0
    while True:
        s = mesh.admin("GET", f"/rollouts/{service}")
        events = [(h["time"], _transition_line(h, mesh)) for h in s["history"][seen_history:]]
        events += [(a["time"], _analysis_line(a)) for a in s["analyses"][seen_analyses:]]
        for _, line in sorted(events):
            print(line, flush=True)
        seen_history, seen_analyses = len(s["history"]), len(s["analyses"])
        if s["state"] in TERMINAL:
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"rollout still {s['state']}: {s['message']}")
        time.sleep(1)


def _transition_line(h: dict[str, Any], mesh: Any) -> str:
    return (
        f"  -> {h['to']:<11} canary {h['canary_weight']:>3}%  "
        f"(ACKed by {_acked(mesh)})  {h['reason']}"
    )


def _analysis_line(a: dict[str, Any]) -> str:
    ttft = a.get("ttft_p99")
    ttft_s = "n/a" if ttft is None else f"{ttft * 1000:.0f}ms"
    rate = a.get("success_rate")
    rate_s = "n/a" if rate is None else f"{rate:.1f}%"
    q = a.get("quality") or {}
    td = q.get("token_disagreement")
    quality = (
        f", quality {q.get('samples', 0)} mirrored calls joined"
        + ("" if td is None else f", token disagreement {td:.1%}")
        if q
        else ""
    )
    return (
        f"     step {a['step'] + 1} @ {a['canary_weight']:>3}%: {a.get('requests', 0)} canary "
        f"calls, success {rate_s}, TTFT p99 {ttft_s}{quality} -> {a['outcome']}"
    )


def _acked(mesh: Any) -> str:
    nodes = mesh.admin("GET", "/debug/syncz")["nodes"]
    ok = sum(
        all(t.get("acked_version") == t.get("sent_version") for t in n["types"].values())
        for n in nodes.values()
    )
    return f"{ok}/{len(nodes)} sidecars"

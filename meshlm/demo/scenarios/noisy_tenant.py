"""`meshlm demo --scenario noisy-tenant`: one tenant floods long generations inside its rate
limit while a quiet tenant of the same priority sends short calls.

Two int4 runtimes, each behind its inbound sidecar (Wasm authz verifies the key and sets
`x-meshlm-tenant`): v1 runs `--no-tenant-isolation` (priority, then arrival), v2 the default
scheduler (a fair share of tokens per tenant inside a priority, per-tenant stream limit, a full
queue sheds the heaviest tenant's backlog first). On each, in the same run: the quiet tenant
alone (its baseline), then the quiet tenant beside the flood. The report adds, per tenant, TTFT
p50/p99 and

    interference_suppression = 1 - (quiet TTFT p99 degradation with isolation)
                                   / (quiet TTFT p99 degradation without)

where a degradation is the quiet tenant's TTFT p99 beside the flood minus alone, on the same
runtime; plus the `sla` object (meshlm/demo/sla.py) of the isolated flood phase.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from meshlm.demo.scenario import report_of, running, say, write_report
from meshlm.demo.scenarios.capacity import STORY_PROMPTS, decode_capacity, flood_tokens

BENCH_TITLE = "Tenant isolation: a tenant floods long generations beside a quiet one"
GOAL = 0.95
SERVE_ARGS = ["--max-batch", "8", "--max-queue", "16"]
QUIET_RATE, QUIET_TOKENS = 1.0, 4
# The flood asks for stories as long as make it FLOOD_LOAD times what a runtime's 8 slots decode
# on this machine, measured first: 48 tokens a call at 3/s flooded a 2-core CPU without AVX-512
# kernels but left 8 slots half empty where they decode int4 3x faster, so the quiet tenant's
# calls never queued behind it and the two schedulers could not be told apart (a degradation of
# -51 ms without isolation, +24 ms with it).
NOISY_RATE, FLOOD_LOAD, NOISY_TOKENS_RANGE = 3.0, 2.0, (48, 256)
# seconds: the quiet tenant alone, beside the flood, and the flood's first seconds left out
PHASES = {"full": (15.0, 40.0, 5.0), "quick": (8.0, 20.0, 4.0), "smoke": (4.0, 10.0, 2.0)}
KEYS = {"quiet": "demo-quiet-key", "noisy": "demo-noisy-key"}
RATE_LIMITS = {  # both inside their limits: the flood is allowed traffic
    "quiet": {"max_tokens": 5, "tokens_per_fill": 2, "fill_interval": "1s"},
    "noisy": {"max_tokens": 10, "tokens_per_fill": 5, "fill_interval": "1s"},
}


def run(args: argparse.Namespace, name: str) -> int:
    report = report_of(
        "noisy-tenant: a flood of long generations beside a quiet tenant",
        lambda: measure_both("full", workdir=args.workdir, say=say),
    )
    if report is None:
        return 1
    s = report["interference_suppression"]
    print(f"interference suppression {s if s is None else f'{100 * s:.1f} %'} "
          f"(goal {100 * GOAL:.0f} %)")  # fmt: skip
    return 0 if s is not None and s > 0.5 else 1


def measure(mechanism: bool, quick: bool) -> dict[str, Any]:
    version = "v2" if mechanism else "v1"
    mesh = _local_mesh(None, versions=[version])
    with running(mesh, say=lambda m: None):
        tokens = _flood_tokens(mesh, version, say=lambda m: None)
        r = _phases(mesh, version, tokens, PHASES["quick" if quick else "full"], say=lambda m: None)
    return {
        k: r[k] for k in ("sla", "tenants", "quiet_alone_ttft_ms", "quiet_ttft_p99_degradation_ms")
    }


def measure_both(phases: str, workdir: Path | None, say: Any) -> dict[str, Any]:
    """One mesh, both schedulers, the report as `meshlm demo` writes it; `phases` names the
    durations in PHASES."""
    mesh = _local_mesh(workdir, versions=["v1", "v2"])
    say(f"logs and report in {mesh.workdir}; v1 --no-tenant-isolation, v2 isolation on")
    with running(mesh, say):
        tokens = _flood_tokens(mesh, "v1", say)
        off = _phases(mesh, "v1", tokens, PHASES[phases], say)
        on = _phases(mesh, "v2", tokens, PHASES[phases], say)
    d_off, d_on = off["quiet_ttft_p99_degradation_ms"], on["quiet_ttft_p99_degradation_ms"]
    suppression = None
    if d_off is not None and d_on is not None and d_off > 0:
        suppression = round(1 - max(0.0, d_on) / d_off, 4)
    report = {
        "scenario": "noisy-tenant",
        "workdir": str(mesh.workdir),
        "traffic": {
            "quiet": {"rate_per_s": QUIET_RATE, "max_new_tokens": QUIET_TOKENS},
            "noisy": {"rate_per_s": NOISY_RATE, "max_new_tokens": tokens},
            "rate_limits": RATE_LIMITS,
            "serve_args": SERVE_ARGS,
        },
        "interference_suppression": suppression,
        "goal": GOAL,
        "sla": on["sla"],
        "isolation_off": off,
        "isolation_on": on,
    }
    write_report(mesh.workdir, report)
    return report


def _local_mesh(workdir: Path | None, versions: list[str]) -> Any:
    from meshlm.demo.launcher import SERVICE, LocalMesh, scenario_mesh
    from wasm_filters.policy import hash_key

    mesh = scenario_mesh({v: 100 // len(versions) for v in versions})
    mesh["tenants"] = {
        name: {
            "key_sha256": hash_key(key),
            "allow": [f"{SERVICE}/Generate"],
            "rate_limit": RATE_LIMITS[name],
            "priority": "normal",  # the same priority: only the fair share tells them apart
        }
        for name, key in KEYS.items()
    }
    # Each phase sends all its calls to one runtime's sidecar, so the default (each of the two
    # sidecars enforces half of a limit) would refuse part of the allowed traffic.
    mesh["rate_limits"] = {"mode": "global"}
    faults = {"v1": [*SERVE_ARGS, "--no-tenant-isolation"], "v2": SERVE_ARGS}
    return LocalMesh(mesh, workdir=workdir, faults=faults)


def _flood_tokens(mesh: Any, version: str, say: Any) -> int:
    """The flood's tokens per call on this machine (the same for both runtimes: the same model
    and batch size on the same cores)."""
    capacity = decode_capacity(f"127.0.0.1:{mesh.runtimes[version].port}", slots=8)
    tokens = flood_tokens(capacity, NOISY_RATE, FLOOD_LOAD, NOISY_TOKENS_RANGE)
    say(f"a runtime decodes {capacity:.0f} tokens/s in 8 slots: the flood asks {tokens} a call")
    return tokens


def _traffic(target: str, tenant: str, rate: float, tokens: int, prompts: Any = None) -> Any:
    from meshlm.demo.traffic import tenant_traffic

    return tenant_traffic(target, tenant, KEYS[tenant], rate, tokens, prompts)


def _phases(
    mesh: Any, version: str, noisy_tokens: int, durations: tuple[float, float, float], say: Any
) -> dict[str, Any]:
    """On one runtime, through its inbound sidecar: warm-up, the quiet tenant alone, then the
    quiet tenant beside the flood (its first seconds left out while the backlog builds)."""
    from meshlm.demo.sla import sla, tenant_summary, ttft

    alone_s, flood_s, settle_s = durations
    target = f"127.0.0.1:{mesh.runtimes[version].inbound_port}"
    warm = _traffic(target, "quiet", 2.0, QUIET_TOKENS).start()
    time.sleep(2.0)
    warm.stop()
    quiet = _traffic(target, "quiet", QUIET_RATE, QUIET_TOKENS).start()
    t_alone = time.monotonic()
    time.sleep(alone_s)
    noisy = _traffic(target, "noisy", NOISY_RATE, noisy_tokens, STORY_PROMPTS).start()
    t_flood = time.monotonic()
    say(f"{version}: quiet alone {alone_s:.0f} s, now beside the flood for {flood_s:.0f} s")
    time.sleep(flood_s)
    quiet.stop()
    noisy.stop()
    alone = [o for o in quiet.outcomes if t_alone <= o.at < t_flood]
    beside = [o for o in quiet.outcomes if o.at >= t_flood + settle_s]
    flood = [o for o in noisy.outcomes if o.at >= t_flood + settle_s]

    alone_p99, beside_p99 = ttft(alone)["p99"], ttft(beside)["p99"]
    degradation = None
    if alone_p99 is not None and beside_p99 is not None:
        degradation = round(beside_p99 - alone_p99, 1)
    say(f"{version}: quiet TTFT p99 alone {alone_p99} ms, beside the flood {beside_p99} ms")
    return {
        "runtime": version,
        "isolation": version != "v1",
        "quiet_alone_ttft_ms": ttft(alone),
        "tenants": {"quiet": tenant_summary(beside), "noisy": tenant_summary(flood)},
        "quiet_ttft_p99_degradation_ms": degradation,
        "sla": sla([*beside, *flood]),
    }

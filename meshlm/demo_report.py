"""The demo's closing report: traffic split per step, latencies, denials by reason, final state."""

from __future__ import annotations

from typing import Any

from meshlm.launcher import LocalMesh


def sidecar_denials(mesh: LocalMesh) -> dict[str, int]:
    """The authz filter's own counters, summed over the inbound sidecars."""
    total: dict[str, int] = {}
    for rt in mesh.runtimes.values():
        for name, value in mesh.envoy_stats(rt.admin_port, "meshlm_authz").items():
            key = name.split("meshlm_authz.", 1)[-1]
            total[key] = total.get(key, 0) + value
    return dict(sorted(total.items()))


def render(report: dict[str, Any]) -> str:
    r, t = report["rollout"], report["traffic"]
    lines = ["", "=== meshlm demo report ==="]
    lines.append(f"rollout {r['service']}: {r['state']} ({r['message']})")
    lines.append(f"final weights: {r['weights']}, stable version: {r['stable']}")
    lines.append("traffic split per step (calls seen at the caller sidecar):")
    for s in r["traffic"]:
        stable = s.get("stable_requests")
        total = s["canary_requests"] + (stable or 0)
        share = (
            f"{100 * s['canary_requests'] / total:.1f}%" if stable is not None and total else "?"
        )
        lines.append(
            f"  step {s['step'] + 1} @ {s['canary_weight']:>3}% canary: "
            f"{s['canary_requests']} canary / {stable} stable = {share} observed"
        )
    lines.append(
        f"requests: {t['requests']} sent, {t['ok']} OK; "
        f"TTFT p50 {t['ttft_ms']['p50']} ms, p99 {t['ttft_ms']['p99']} ms"
    )
    lines.append("outcomes by tenant (gRPC status):")
    for tenant, counts in t["by_tenant"].items():
        lines.append(f"  {tenant:<9} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    lines.append("authz filter counters (inbound sidecars):")
    for k, v in report["denials_at_sidecars"].items():
        lines.append(f"  {k}: {v}")
    return "\n".join(lines)

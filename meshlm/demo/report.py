"""The demo's closing report: traffic split per step, latencies, denials by reason, final state;
per analysis interval, what the gate read from the canary runtime beside what the demo's own
client saw from each version over the same interval."""

from __future__ import annotations

from typing import Any

from meshlm.demo.identity import handshakes
from meshlm.demo.launcher import SERVICE, LocalMesh
from meshlm.demo.sla import percentile
from meshlm.demo.traffic import Outcome
from sidecar.bootstrap import XDS_CLUSTER
from xds_server.resources.names import inbound_cluster, outbound_cluster


def sidecar_denials(mesh: LocalMesh) -> dict[str, int]:
    """The authz filter's own counters, summed over the inbound sidecars."""
    total: dict[str, int] = {}
    for rt in mesh.runtimes.values():
        for name, value in mesh.envoy_stats(rt.admin_port, "meshlm_authz").items():
            key = name.split("meshlm_authz.", 1)[-1]
            total[key] = total.get(key, 0) + value
    return dict(sorted(total.items()))


def identity_report(mesh: LocalMesh) -> dict[str, Any]:
    """Per sidecar its workload identity as its agent holds it and whether its Envoy presents
    it; per hop whether it ran over mTLS, read from Envoy's TLS handshake counters on both ends
    (what Envoy did, not what the mesh file asks for)."""
    if mesh.certs is None:
        return {"enabled": False, "sidecars": {}, "hops": []}
    ports = mesh.sidecar_admin_ports()
    seen = {name: handshakes(port) for name, port in ports.items()}
    hops = []

    def hop(kind: str, src: str, dst: str, at_src: int, at_dst: int | None) -> None:
        # TLS handshakes counted by the Envoy at each end (None: the other end is no Envoy).
        tls = at_src > 0 and (at_dst is None or at_dst > 0)
        shakes = {"from": at_src, "to": at_dst}
        hops.append({"kind": kind, "from": src, "to": dst, "mtls": tls, "handshakes": shakes})

    for name, rt in mesh.runtimes.items():
        sidecar = f"sidecar-{name}"
        inbound = sum(v for k, v in seen[sidecar].items() if k.startswith("listener."))
        to_version = seen["sidecar-caller"].get(f"cluster.{outbound_cluster(SERVICE, rt.version)}")
        hop("mesh", "sidecar-caller", sidecar, to_version or 0, inbound)
        local = seen[sidecar].get(f"cluster.{inbound_cluster(SERVICE, rt.version)}", 0)
        hop("local", sidecar, f"runtime-{name}", local, None)
    for name in ports:  # ADS
        hop("ads", name, "control plane", seen[name].get(f"cluster.{XDS_CLUSTER}", 0), None)
    return {"enabled": True, "sidecars": mesh.certs.summary(ports), "hops": hops}


def gates_beside_client(
    rollout: dict[str, Any],
    outcomes: list[Outcome],
    versions: dict[str, str],
    wall_minus_mono: float,
) -> list[dict[str, Any]]:
    """One row per analysis interval: the gate's reading (the canary runtime's TTFT p99 and
    sample count over the interval) and the client's TTFT of the OK calls whose first token came
    in the same interval (what the runtime counts), per version that answered.
    `wall_minus_mono`: time.time() - time.monotonic()."""
    starts = sorted(h["time"] for h in rollout["history"] if h["to"] == "Progressing")
    rows, previous = [], 0.0
    for a in rollout["analyses"]:
        begin = max([previous, *(t for t in starts if t <= a["time"])])
        previous = a["time"]
        seen: dict[str, list[float]] = {}
        for o in outcomes:
            if o.status != "OK" or o.ttft_ms is None:
                continue
            first_token = o.at + o.ttft_ms / 1e3 + wall_minus_mono
            if begin <= first_token < a["time"]:
                seen.setdefault(versions.get(o.replica, "?"), []).append(o.ttft_ms)
        ttft = a.get("ttft_p99")
        rows.append({
            "step": a["step"], "canary_weight": a["canary_weight"], "outcome": a["outcome"],
            "reason": a.get("reason", ""),
            "interval_s": round(a["time"] - begin, 1),
            "gate_ttft_p99_ms": None if ttft is None else round(ttft * 1e3, 1),
            "gate_samples": a.get("latency_samples"), "gate_over": a.get("latency_over"),
            "client_ttft_ms": {
                v: {"count": len(x), "p50": percentile(x, 50), "p99": percentile(x, 99)}
                for v, x in sorted(seen.items())
            },
        })  # fmt: skip
    return rows


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
    if report.get("steps"):
        lines.append(
            "TTFT per analysis interval: the gate (canary runtime) | the client, per version:"
        )
        for s in report["steps"]:
            client = "; ".join(
                f"{v} p50 {c['p50']} / p99 {c['p99']} ms ({c['count']})"
                for v, c in s["client_ttft_ms"].items()
            )
            lines.append(
                f"  step {s['step'] + 1} @ {s['canary_weight']:>3}% ({s['interval_s']:g}s, "
                f"{s['outcome']}): gate p99 {s['gate_ttft_p99_ms']} ms ({s['gate_samples']}) "
                f"| {client or 'no calls'}"
            )
            if s["outcome"] != "pass":
                lines.append(f"    {s['reason']}")
    lines.append(
        f"requests: {t['requests']} sent, {t['ok']} OK; "
        f"TTFT p50 {t['ttft_ms']['p50']} ms, p99 {t['ttft_ms']['p99']} ms"
    )
    for v, b in t.get("by_version", {}).items():
        lines.append(
            f"  answered by {v}: {b['count']} calls, TTFT p50 {b['ttft_ms']['p50']} / "
            f"p99 {b['ttft_ms']['p99']} ms; in its runtime: TTFT p99 "
            f"{b['server_ttft_ms']['p99']} ms, queue wait p99 {b['queue_wait_ms']['p99']} ms"
        )
    for api, a in t.get("by_api", {}).items():
        name = "OpenAI HTTP (openai SDK)" if api == "openai" else "gRPC"
        per_version = "; ".join(
            f"{v} {b['count']} calls, TTFT p50 {b['ttft_ms']['p50']} / p99 {b['ttft_ms']['p99']} ms"
            for v, b in a["by_version"].items()
        )
        lines.append(f"  {name}: {a['ok']}/{a['requests']} OK; {per_version or 'none answered'}")
    lines.append("outcomes by tenant (gRPC status; an OpenAI call's HTTP status as its gRPC one):")
    for tenant, counts in t["by_tenant"].items():
        lines.append(f"  {tenant:<9} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    lines.append("authz filter counters (inbound sidecars):")
    for k, v in report["denials_at_sidecars"].items():
        lines.append(f"  {k}: {v}")
    lines.append(_identity_line(report.get("identity")))
    return "\n".join(lines)


def _identity_line(ident: dict[str, Any] | None) -> str:
    if not ident or not ident["enabled"]:
        return "identity: off (no `identity:` in the mesh file): every hop plaintext"
    cars = ident["sidecars"].values()
    ids = sorted({c["spiffe_id"] for c in cars if c["spiffe_id"]})
    renewals = sum(c.get("renewals", 0) for c in cars)
    rotations = max((c.get("root_rotations", 0) for c in cars), default=0)

    def share(kind: str) -> str:
        hs = [h for h in ident["hops"] if h["kind"] == kind]
        return f"{sum(h['mtls'] for h in hs)}/{len(hs)}"

    return (
        f"identity: {len(ids)} SPIFFE IDs ({', '.join(ids)}), {renewals} certificate renewals, "
        f"{rotations} root rotations seen; mTLS on caller -> inbound sidecar hops "
        f"{share('mesh')}, sidecar -> control plane (ADS) {share('ads')}, sidecar -> its "
        f"runtime on loopback {share('local')}"
    )

"""`GET /budgets`: each tenant's token budget and what is left of it, per service.

`rate_limits.mode: global`: the control plane's own buckets (xds_server/ratelimit/budgets.py).
`local`: the runtimes keep the shares, so the figures are read from each version's
`metrics_urls` (the runtimes' /metrics.json, `token_budgets`), summed over the runtimes that
answered; a runtime that has not served the tenant yet holds its whole share.
"""

from __future__ import annotations

from typing import Any

from xds_server import mesh as m
from xds_server.ratelimit.budgets import budget_of
from xds_server.rollout.gates.fetch import MeasurementError, get_json

READ_TIMEOUT_S = 2.0  # per runtime: a status read must not hang on one


def handle(cp: Any):  # -> admin Mount
    def mount(method: str, target: str, body: bytes) -> tuple[int, Any]:
        if method != "GET" or target.split("?")[0].rstrip("/") != "/budgets":
            return 404, {"error": f"no such endpoint: {method} {target.split('?')[0]}"}
        mesh = cp.mesh
        budgets = {t.name: b for t in _tenants(mesh) if (b := budget_of(mesh, t.name))}
        if mesh.rate_limits.mode == "global":
            kept = cp.token_budgets.buckets.levels() if cp.token_budgets is not None else {}
            left = {svc: _global_left(kept, svc, budgets) for svc in mesh.services}
            runtimes: dict[str, Any] = {}
        else:
            read = {svc.name: _runtime_levels(svc) for svc in mesh.services.values()}
            left = {n: _local_left(r, mesh.services[n], budgets) for n, r in read.items()}
            runtimes = {n: {"read": len(r[0]), "unreachable": r[1]} for n, r in read.items()}
        tenants = {
            t: {"budget": b, "left": {svc: left[svc][t] for svc in mesh.services}}
            for t, b in budgets.items()
        }
        reply: dict[str, Any] = {"mode": mesh.rate_limits.mode, "tenants": tenants}
        if runtimes:
            reply["runtimes"] = runtimes
        return 200, reply

    return mount


def _tenants(mesh: m.Mesh) -> tuple[Any, ...]:
    return getattr(mesh.tenants, "tenants", ())


def _global_left(kept: dict, svc: str, budgets: dict[str, dict[str, int]]) -> dict:
    return {
        t: {name: round(kept.get(f"{svc}/{t}", {}).get(name, b)) for name, b in budget.items()}
        for t, budget in budgets.items()
    }


def _runtime_levels(svc: m.Service) -> tuple[list[dict], list[str]]:
    """(each answering runtime's token_budgets, the URLs that did not answer)."""
    levels, unreachable = [], []
    for version in svc.versions.values():
        for url in version.metrics_urls:
            try:
                doc = get_json(url, READ_TIMEOUT_S)
                levels.append(doc.get("token_budgets") or {} if isinstance(doc, dict) else {})
            except MeasurementError:
                unreachable.append(url)
    return levels, unreachable


def _local_left(
    read: tuple[list[dict], list[str]], svc: m.Service, budgets: dict[str, dict[str, int]]
) -> dict:
    """Per tenant and budget, the tokens left summed over the runtimes that answered."""
    levels, _ = read
    share = max(1, svc.inbound_sidecars)
    out: dict[str, dict[str, int]] = {}
    for t, budget in budgets.items():
        out[t] = {}
        for name, b in budget.items():
            held = [lv.get(t, {}).get(name) for lv in levels]
            out[t][name] = round(sum(b // share if h is None else h for h in held))
    return out

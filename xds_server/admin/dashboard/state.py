"""The dashboard's state document: what the page shows, read from the state the control plane
keeps anyway (the live mesh, sync status, rollouts, SLO loops, isolation) plus, every few
seconds, the caller sidecars' Envoy stats (per-version calls, tenants' authz counters) and the
runtimes' metrics, the sources the gates read (xds_server/rollout/sources.py). Nothing in it is a
secret: names from the mesh file, versions, counts, error texts of NACKs."""

from __future__ import annotations

import logging
import re
import urllib.parse
from collections.abc import Callable
from typing import Any

from xds_server.resources.names import outbound_cluster
from xds_server.rollout import sources as discovery
from xds_server.rollout.gates.envoy_stats import EnvoyStatsSource, GrpcCounts
from xds_server.rollout.gates.fetch import MeasurementError, get_json
from xds_server.rollout.gates.runtime_metrics import RuntimeMetricsSource

log = logging.getLogger(__name__)

ANALYSES_SHOWN = 12  # a rollout's last analysis records
SLO_ACTIONS_SHOWN = 8
# An analysis record's fields shown: the gate readings of one interval
# (xds_server/rollout/controller.py)
_ANALYSIS = ("step", "canary_weight", "outcome", "reason", "success_rate", "requests",
             "ttft_p99", "tpot_p99")  # fmt: skip
# The authz filter's tenant counters (wasm_filters/authz.zig); Envoy may prefix custom stats.
# The filter runs on inbound listeners: only a sidecar listed in caller_sidecars that also has
# one carries them (the control plane is told no other sidecar's admin URL).
_TENANT_STAT = re.compile(r"meshlm_authz\.(allowed|denied\.forbidden|denied\.rate_limited)\.(.+)\Z")
_TENANT_QUERY = "/stats?format=json&filter=" + urllib.parse.quote(r"meshlm_authz\.", safe="")


def live(cp: Any, rollouts: Any, slo: Any) -> dict[str, Any]:
    """Everything read from memory (cheap): services' weights, rollouts, SLO actions,
    quarantines and each sidecar's ACKed versions and last NACK. No clock in it, so two
    readings compare equal when nothing changed."""
    mesh = cp.mesh
    ro = _safe(rollouts.status, {}) if rollouts is not None else {}
    loops = dict(slo.loops) if slo is not None else {}
    iso = _safe(cp.isolation.status, {})
    services = {}
    for name, svc in sorted(mesh.services.items()):
        services[name] = {
            "versions": sorted(svc.versions),
            "weights": dict(svc.route.weights),
            "rollout": _rollout(ro[name]) if name in ro else None,
            "slo": _slo(loops[name]) if name in loops else None,
            "quarantined": len(iso[name]["quarantined"]) if name in iso else None,
            "classes_tracked": iso[name]["classes_tracked"] if name in iso else None,
        }
    return {
        "incarnation": cp.incarnation,
        "generation": cp.cache.generation,
        "services": services,
        "sidecars": _sidecars(cp.sync.to_json()["nodes"]),
    }


def _safe(read: Callable[[], Any], default: Any) -> Any:
    try:
        return read()
    except Exception:  # one failing part must not blank the page
        log.exception("dashboard: reading %s failed", getattr(read, "__qualname__", read))
        return default


def _rollout(r: dict[str, Any]) -> dict[str, Any]:
    spec = r["spec"]
    return {
        "state": r["state"],
        "started": r["history"][0]["time"] if r["history"] else None,
        "step": r["step"],
        "steps": list(spec.get("steps", [])),
        "canary": spec.get("canary"),
        "from": spec.get("stable"),  # the stable version when it started
        "stable": r["stable"],  # the stable version now (the canary once promoted)
        "canary_weight": r["canary_weight"],
        "failures": r["failures"],
        "message": r["message"],
        "analyses": [{k: a.get(k) for k in _ANALYSIS} for a in r["analyses"][-ANALYSES_SHOWN:]],
    }


def _slo(loop: Any) -> dict[str, Any]:
    st = loop.status()
    return {
        "level": st["level"],
        "in_force": list(st["in_force"]),
        "plan": list(loop.plan),
        "actions": [
            {k: h.get(k) for k in ("time", "action", "direction", "done", "reason")}
            for h in st["history"][-SLO_ACTIONS_SHOWN:]
        ],
    }


def _sidecars(nodes: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for nid, n in sorted(nodes.items()):
        types = {}
        for short, ts in sorted(n["types"].items()):
            types[short] = {
                "acked": ts["acked_version"],
                "nack": ts["nack_version"],
                "nack_error": ts["nack_error"],
            }
        out.append({"id": nid, "connected": n["connected"], "api": n["api"],
                    "lagging": n["lagging"], "error": n["error"], "types": types})  # fmt: skip
    return out


def measured(cp: Any, timeout: float = 1.0) -> dict[str, Any]:
    """What the gates read, now: per service and version the callers' cumulative gRPC counts
    and success rate, the runtimes' TTFT/TPOT p99; tenants' allowed/denied counts summed
    over the caller sidecars. Sources that are not configured are left out; one that does
    not answer is named in `errors`."""
    errors: list[str] = []
    try:
        callers = discovery.caller_admin_urls(cp)
    except MeasurementError:
        callers = []
    versions: dict[str, dict[str, Any]] = {}
    for name, svc in sorted(cp.mesh.services.items()):
        for v, ver in sorted(svc.versions.items()):
            row: dict[str, Any] = {}
            if callers:
                try:
                    counts = EnvoyStatsSource(callers, outbound_cluster(name, v), timeout=timeout)
                    total = sum(counts.read().values(), start=GrpcCounts())
                    row.update(requests=total.total, success_rate=total.success_rate)
                except MeasurementError as e:
                    errors.append(str(e))
            if ver.metrics_urls:
                try:
                    lat = RuntimeMetricsSource(list(ver.metrics_urls), timeout=timeout).read()
                    row.update(ttft_p99=lat.ttft_p99, tpot_p99=lat.tpot_p99)
                except MeasurementError as e:
                    errors.append(str(e))
            if row:
                versions.setdefault(name, {})[v] = row
    return {"versions": versions, "tenants": _tenants(callers, timeout, errors), "errors": errors}


def _tenants(callers: list[str], timeout: float, errors: list[str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for url in callers:
        try:
            doc = get_json(url.rstrip("/") + _TENANT_QUERY, timeout)
        except MeasurementError as e:
            errors.append(str(e))
            continue
        for s in doc.get("stats", []):
            m = _TENANT_STAT.search(str(s.get("name", "")))
            if m and isinstance(s.get("value"), int):
                kind = "allowed" if m.group(1) == "allowed" else "denied"
                row = out.setdefault(m.group(2), {"allowed": 0, "denied": 0})
                row[kind] += s["value"]
    return out

"""`meshlm status`: the sync status of every sidecar and every rollout, from the control
plane's admin API."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

from meshlm import status_csds
from meshlm.admin_client import AdminClient, AdminError, add_admin_client_arguments
from meshlm.commands.fault import fault_line
from meshlm.logs import escape
from meshlm.watch import add_watch_argument, watch

ORDER = ("CDS", "EDS", "LDS", "ECDS", "RDS")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_admin_client_arguments(p, token=False)  # reads only: no token
    p.add_argument("--json", action="store_true", help="print the raw /debug/syncz JSON")
    add_watch_argument(p)
    status_csds.add_arguments(p)


def _get(admin: AdminClient, path: str) -> Any:
    """The JSON at `path`; AdminError for an error status too."""
    code, doc = admin.request("GET", path, timeout=10)
    if code >= 400:
        err = doc.get("error", doc) if isinstance(doc, dict) else doc
        raise AdminError(f"{admin.url}{path}: HTTP {code}: {err}")
    return doc


def run(args: argparse.Namespace) -> int:
    if args.csds:  # CSDS on the ADS port instead of the admin API
        return watch(lambda: status_csds.show(args), args.watch)
    try:
        admin = AdminClient.from_args(args)
    except AdminError as e:
        print(f"meshlm status: {e}", file=sys.stderr)
        return 1
    return watch(lambda: show(admin, args.json, args.cacert), args.watch)


def show(admin: AdminClient, as_json: bool, cacert: str | None = None) -> int:
    """Print the status once; 1 when the control plane cannot be read. `cacert` is also the
    root of the leader's admin API when replicas are asked."""
    try:
        doc = _get(admin, "/debug/syncz")
    except AdminError as e:
        print(f"meshlm status: {e}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(doc, indent=1))
        return 0
    # A control plane without rollouts mounted, an older one, one without the SLO loop: {}.
    rollouts, isolation, slo, traffic = ({} for _ in range(4))
    with contextlib.suppress(AdminError):
        rollouts = _get(admin, "/rollouts")
    with contextlib.suppress(AdminError):
        traffic = _get(admin, "/traffic")
    with contextlib.suppress(AdminError):
        isolation = _get(admin, "/isolation")
    with contextlib.suppress(AdminError):
        slo = _get(admin, "/slo")
    faults: list = []
    with contextlib.suppress(AdminError):
        faults = _get(admin, "/v1/faults").get("faults") or []
    budgets: dict[str, Any] = {}
    with contextlib.suppress(AdminError):
        budgets = _get(admin, "/budgets")
    if replica := render_replica(admin, cacert):
        print(replica)
    print(render(doc))
    if doc.get("registrations"):
        print("\n" + render_registrations(doc["registrations"]))
    if traffic.get("stranded"):
        print("\n" + "\n".join(s["message"] for s in traffic["stranded"]))
    if rollouts:
        print("\n" + render_rollouts(rollouts))
    if any(s.get("quarantined") for s in isolation.values()):
        print("\n" + render_isolation(isolation))
    if slo:
        print("\n" + render_slo(slo))
    if faults:
        print("\nfaults:\n" + "\n".join(f"  {fault_line(f)}" for f in faults))
    if budgets.get("tenants"):
        print("\n" + render_budgets(budgets))
    return 0


def render_budgets(doc: dict[str, Any]) -> str:
    """Each tenant's token budgets and what is left per service (used %). Local mode: summed
    over the runtimes that answered (their /metrics.json), naming those that did not."""
    lines = ["TOKEN BUDGET  TENANT  BUDGET  SERVICE  LEFT  USED"]
    for tenant, row in sorted(doc["tenants"].items()):
        for name, budget in sorted(row.get("budget", {}).items()):
            for svc, left in sorted(row.get("left", {}).items()):
                n = left.get(name, budget)
                used = 1 - n / budget if budget else 0
                label = name.removeprefix("tokens_")
                lines.append(f"  {tenant}  {budget} {label}  {svc}  {n}  {used:.0%}")
    for svc, r in sorted(doc.get("runtimes", {}).items()):
        line = f"  {svc}: kept by its runtimes, {r['read']} read"
        if r.get("unreachable"):
            line += f"; unreachable: {', '.join(r['unreachable'])}"
        lines.append(line)
    return "\n".join(lines)


def render_replica(admin: AdminClient, cacert: str | None = None) -> str:
    """Replicas on a store: which one answers, who leads, and what the leader's work
    (rollouts, SLO loop) is doing, as the leader itself says; "" for a single control plane."""
    with contextlib.suppress(AdminError):
        me = _get(admin, "/")
        if isinstance(me, dict) and me.get("replica"):
            return _replica_line(me, cacert)
    return ""


def _replica_line(me: dict[str, Any], cacert: str | None) -> str:
    store = me.get("store") or {}
    line = f"replica {me['replica']} ({'leader' if me.get('leading') else 'follower'}"
    line += f", store revision {store.get('revision', '?')})"
    if store.get("store_error"):
        line += f", store: {store['store_error']}"
    leader = me.get("leader")
    if not leader:
        why = f": {me['election_error']}" if me.get("election_error") else ""
        return f"{line}\nleader: none known{why}"
    where = (leader.get("info") or {}).get("admin", "")
    line += f"\nleader {leader['id']} (term {leader['term']}, since {leader.get('since_iso', '?')}"
    line += f"{f', {where}' if where else ''})"
    if me.get("leading"):
        return f"{line}, its work: {me.get('leader_work', '?')}"
    if not where:
        return f"{line}, its work: unknown (it published no admin URL)"
    try:  # the leader's own word on its work; a follower only knows it follows
        theirs = _get(AdminClient(where, cacert=cacert), "/")
        work = theirs.get("leader_work", "?") if theirs.get("replica") == leader["id"] else None
        work = work or f"unknown ({where} is not {leader['id']} any more)"
    except AdminError as e:
        work = f"unknown ({e})"
    return f"{line}, its work: {work}"


def render_registrations(rows: list[dict[str, Any]]) -> str:
    """One line per host that registered itself: where, what, since when, its health."""
    table = [("REGISTERED", "SERVICE", "ZONE", "SINCE", "HEALTH", "NODE")]
    for r in rows:
        health = r.get("health", "?")
        if r.get("stream") == "lost":  # removed once the grace period ends
            health += " (stream lost)"
        node = r.get("node", "")
        if r.get("spiffe_id"):
            node += f" {r['spiffe_id']}"
        table.append((
            r.get("address", "?"), f"{r.get('service')}/{r.get('version')}", r.get("zone") or "-",
            r.get("since_iso", "?"), health, escape(node),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row[:5], widths, strict=True)) + "  " + row[5]
        for row in table
    )


def render_slo(slo: dict[str, Any]) -> str:
    """Per service: the SLO loop's last interval and the actions in force, with their reasons."""
    lines = ["SLO  DEVIATION  IN FORCE  LAST"]
    for service, s in sorted(slo.items()):
        last = s.get("last") or {}
        dev = last.get("deviation")
        dev_s = "n/a" if dev is None else f"{dev:+.0%}"
        in_force = ",".join(s.get("in_force") or []) or "-"
        lines.append(f"{service}  {dev_s}  {in_force}  {last.get('worst', '')}")
        for h in s.get("history", [])[-5:]:
            lines.append(f"  {h['direction']} {h['action']}: {h['done']} ({h['reason']})")
    return "\n".join(lines)


def render_isolation(isolation: dict[str, Any]) -> str:
    """One line per quarantined request class."""
    lines = ["QUARANTINE  CLASS  STATE  SINCE  ACKED  WHY"]
    for service, s in sorted(isolation.items()):
        for q in s.get("quarantined", []):
            acked = q.get("applied") or "pending"
            lines.append(
                f"{service}  {q['key']}  {q['state']}  {q.get('since_iso', '?')}  {acked}  "
                f"{q.get('why', '')}"
            )
    return "\n".join(lines)


def render_rollouts(rollouts: dict[str, Any]) -> str:
    lines = ["ROLLOUT  STATE  WEIGHTS  MESSAGE"]
    for service, r in sorted(rollouts.items()):
        weights = " ".join(f"{v}={w}" for v, w in r.get("weights", {}).items())
        lines.append(f"{service}  {r.get('state')}  {weights}  {r.get('message', '')}")
    return "\n".join(lines)


def render(doc: dict[str, Any]) -> str:
    rows = [("NODE", "TYPE", "SENT", "ACKED", "ERROR")]
    for node_id, ns in sorted(doc.get("nodes", {}).items()):
        name = node_id if ns.get("connected") else f"{node_id} (disconnected)"
        if ns.get("lagging"):  # left out of the ACK quorum (control_plane.lagging_after)
            name += " (lagging)"
        if ns.get("spiffe_id"):  # from its client certificate: ADS over mTLS
            name += f" {ns['spiffe_id']}"
        if ns.get("error"):
            rows.append((name, "-", "-", "-", escape(ns["error"])))
        types = ns.get("types", {})
        for short in sorted(types, key=lambda s: ORDER.index(s) if s in ORDER else 99):
            ts = types[short]
            err = ""
            if ts.get("nack_error") and ts.get("nack_version") != ts.get("acked_version"):
                err = escape(f"NACK {ts['nack_version']}: {ts['nack_error']}")
            rows.append((name, short, ts["sent_version"], ts["acked_version"], err))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
             for r in rows]  # fmt: skip
    conv = doc.get("convergence", {})
    if conv.get("count"):
        lines.append(
            f"\nconvergence over {conv['count']} changes: p50 {conv['p50_seconds'] * 1000:.1f} ms, "
            f"p99 {conv['p99_seconds'] * 1000:.1f} ms"
        )
    lines.insert(
        0, f"incarnation {doc.get('incarnation', '?')}, generation {doc.get('generation')}"
    )
    return "\n".join(line.rstrip() for line in lines)

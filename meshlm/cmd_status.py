"""`meshlm status`: the sync status of every sidecar and every rollout, from the control
plane's admin API."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

ORDER = ("CDS", "EDS", "LDS", "ECDS", "RDS")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--admin", default="http://127.0.0.1:18001", help="control plane admin URL")
    p.add_argument("--json", action="store_true", help="print the raw /debug/syncz JSON")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def run(args: argparse.Namespace) -> int:
    base = args.admin.rstrip("/")
    try:
        doc = _get(base + "/debug/syncz")
    except (OSError, urllib.error.URLError, ValueError) as e:
        print(f"meshlm status: cannot read {base}/debug/syncz: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    try:
        rollouts = _get(base + "/rollouts")
    except (OSError, urllib.error.URLError, ValueError):
        rollouts = {}  # a control plane without rollouts mounted
    try:
        isolation = _get(base + "/isolation")
    except (OSError, urllib.error.URLError, ValueError):
        isolation = {}  # an older control plane
    try:
        slo = _get(base + "/slo")
    except (OSError, urllib.error.URLError, ValueError):
        slo = {}  # a control plane without the SLO loop
    print(render(doc))
    if rollouts:
        print("\n" + render_rollouts(rollouts))
    if any(s.get("quarantined") for s in isolation.values()):
        print("\n" + render_isolation(isolation))
    if slo:
        print("\n" + render_slo(slo))
    return 0


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
    """One line per quarantined request class (issue 11)."""
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
        if ns.get("error"):
            rows.append((name, "-", "-", "-", ns["error"]))
        types = ns.get("types", {})
        for short in sorted(types, key=lambda s: ORDER.index(s) if s in ORDER else 99):
            ts = types[short]
            err = ""
            if ts.get("nack_error") and ts.get("nack_version") != ts.get("acked_version"):
                err = f"NACK {ts['nack_version']}: {ts['nack_error']}"
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

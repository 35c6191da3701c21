"""`meshlm rollout start|status|pause|resume|abort|promote SERVICE`: steer a canary rollout
through the control plane's admin HTTP API (`/rollouts`, see xds_server/rollout/api.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from meshlm.admin_client import AdminClient, AdminError, add_admin_client_arguments
from meshlm.watch import add_watch_argument, watch
from xds_server.admin.token import TokenError

ACTIONS = ("start", "status", "pause", "resume", "abort", "promote")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=ACTIONS, help="what to do: " + ", ".join(ACTIONS))
    p.add_argument("service", nargs="?", help="the service (status without one lists all)")
    add_admin_client_arguments(p)
    p.add_argument("--json", action="store_true", help="print the raw JSON reply")
    p.add_argument("--timeout", type=float, default=120.0, help="HTTP timeout in seconds")
    add_watch_argument(p)  # status only
    s = p.add_argument_group("start (defaults: the mesh file's rollouts.SERVICE)")
    s.add_argument("--stable", help="the version serving today")
    s.add_argument("--canary", help="the version to roll out")
    s.add_argument("--steps", help="canary weights, e.g. 5,25,50,100")
    s.add_argument("--interval", help="analysis interval per step, e.g. 10s")
    s.add_argument("--threshold", type=int, help="failed intervals before rollback")
    s.add_argument("--success-rate-min", type=float, help="gate: gRPC success rate in %%")
    s.add_argument("--ttft-p99-max", help="gate: e.g. 800ms")
    s.add_argument("--tpot-p99-max", help="gate: e.g. 100ms")
    s.add_argument("--min-requests", type=int, help="gate: fewer calls per interval halt")


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    for key in ("stable", "canary", "interval", "threshold"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    if args.steps:
        try:
            spec["steps"] = [int(x) for x in args.steps.split(",") if x.strip()]
        except ValueError:
            msg = f"--steps: expected numbers like 5,25,50,100, got {args.steps!r}"
            raise SystemExit(msg) from None
    gates = {
        "grpc_success_rate_min": args.success_rate_min,
        "ttft_p99_max": args.ttft_p99_max,
        "tpot_p99_max": args.tpot_p99_max,
        "min_requests": args.min_requests,
    }
    gates = {k: v for k, v in gates.items() if v is not None}
    if gates:
        spec["gates"] = gates
    return spec


def render(st: dict[str, Any]) -> str:
    """A short human summary of one rollout."""
    spec = st["spec"]
    w = st["weights"]
    lines = [
        f"{st['service']}: {st['state']}  {spec['stable']} {w.get(spec['stable'], 0)} % / "
        f"{spec['canary']} {w.get(spec['canary'], 0)} %  (stable: {st['stable']}, "
        f"step {st['step'] + 1}/{len(spec['steps'])}, failures {st['failures']}/"
        f"{spec['threshold']})",
        f"  {st['message']}",
    ]
    if st.get("lagging"):
        lines.append(f"  lagging sidecars: {', '.join(st['lagging'])}")
    for a in st.get("analyses", [])[-3:]:
        lines.append(f"  analysis @ {a['canary_weight']} %: {a['outcome']}: {a['reason']}")
    for h in st.get("history", []):
        t = time.strftime("%H:%M:%S", time.localtime(h["time"]))
        lines.append(f"  {t} {h['to']}: {h['reason']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        admin = AdminClient.from_args(args)
    except (AdminError, TokenError) as e:
        print(f"meshlm rollout: {e}", file=sys.stderr)
        return 2
    if args.action != "status" and not args.service:
        print(f"meshlm rollout {args.action}: SERVICE is required", file=sys.stderr)
        return 2
    if args.watch is not None and args.action != "status":
        print(f"meshlm rollout {args.action}: --watch is for status only", file=sys.stderr)
        return 2
    return watch(lambda: _once(args, admin), args.watch)


def _once(args: argparse.Namespace, admin: AdminClient) -> int:
    if args.action == "start":
        method, path, body = "POST", f"/rollouts/{args.service}", _spec(args)
    elif args.action == "status":
        method, path, body = "GET", "/rollouts" + (f"/{args.service}" if args.service else ""), None
    else:
        method, path, body = "POST", f"/rollouts/{args.service}/{args.action}", None
    try:
        code, reply = admin.request(method, path, body, args.timeout)
    except AdminError as e:
        print(f"meshlm rollout: {e}", file=sys.stderr)
        return 1
    if code >= 400:
        err = reply.get("error", reply) if isinstance(reply, dict) else reply
        if code == 401:
            err = f"{err} (token: {admin.token_source})"
        print(f"meshlm rollout {args.action}: HTTP {code}: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(reply, indent=1))
    elif args.action == "status" and not args.service:
        print("\n".join(render(st) for st in reply.values()) or "no rollouts")
    else:
        print(render(reply))
    failed = isinstance(reply, dict) and reply.get("state") in ("Failed",)
    return 1 if failed else 0

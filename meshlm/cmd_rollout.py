"""`meshlm rollout start|status|pause|resume|abort|promote SERVICE`: steer a canary rollout
through the control plane's admin HTTP API (`/rollouts`, see xds_server/rollout_api.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from xds_server.admin_token import TOKEN_ENV, TokenError, client_token

ACTIONS = ("start", "status", "pause", "resume", "abort", "promote")


def add_admin_client_arguments(p: argparse.ArgumentParser) -> None:
    """`--admin` and `--token-file`, as every client of the control plane's admin API takes them."""
    p.add_argument("--admin", default="http://127.0.0.1:18001", help="control plane admin URL")
    p.add_argument("--token-file", help=f"file holding the admin bearer token (default: "
                   f"${TOKEN_ENV}, else the local control plane's token file)")  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=ACTIONS)
    p.add_argument("service", nargs="?", help="the service (status without one lists all)")
    add_admin_client_arguments(p)
    p.add_argument("--json", action="store_true", help="print the raw JSON reply")
    p.add_argument("--timeout", type=float, default=120.0, help="HTTP timeout in seconds")
    s = p.add_argument_group("start (defaults: the mesh file's rollouts.SERVICE)")
    s.add_argument("--stable")
    s.add_argument("--canary")
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


def request(
    admin: str, method: str, path: str, body: dict | None, token: str | None, timeout: float
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(admin.rstrip("/") + path, data=data, method=method)
    req.add_header("content-type", "application/json")
    if token:
        req.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"error": raw.decode(errors="replace") or e.reason}


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
        token, source = client_token(args.admin, args.token_file)
    except TokenError as e:
        print(f"meshlm rollout: {e}", file=sys.stderr)
        return 2
    if args.action != "status" and not args.service:
        print(f"meshlm rollout {args.action}: SERVICE is required", file=sys.stderr)
        return 2
    if args.action == "start":
        method, path, body = "POST", f"/rollouts/{args.service}", _spec(args)
    elif args.action == "status":
        method, path, body = "GET", "/rollouts" + (f"/{args.service}" if args.service else ""), None
    else:
        method, path, body = "POST", f"/rollouts/{args.service}/{args.action}", None
    try:
        code, reply = request(args.admin, method, path, body, token, args.timeout)
    except (OSError, urllib.error.URLError) as e:
        print(
            f"meshlm rollout: cannot reach the control plane at {args.admin}: {e}", file=sys.stderr
        )
        return 1
    if code >= 400:
        err = reply.get("error", reply) if isinstance(reply, dict) else reply
        if code == 401:
            err = f"{err} (token: {source})"
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

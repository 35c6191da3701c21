"""`meshlm fault add|list|remove`: fault injection through the control plane's admin API
(/v1/faults). `add NAME --service S [--version V] [--host IP:PORT] [--header NAME=VALUE]
[--delay 500ms] [--abort-http 503 | --abort-grpc 14] [--percent P] [--duration 2m]` answers once
the affected sidecars ACKed it (the callers', or with --host that host's own); the control plane
removes it when its duration ends."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any
from urllib.parse import quote

from meshlm.admin_client import AdminClient, AdminError, add_admin_client_arguments
from meshlm.commands.apply import acked_line, failure
from xds_server.admin.token import TokenError

ACTIONS = ("add", "list", "remove")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=ACTIONS, help="what to do: " + ", ".join(ACTIONS))
    p.add_argument("name", nargs="?", help="the fault's name (add, remove)")
    p.add_argument("--service", help="the service whose calls get the fault (add)")
    p.add_argument("--version", help="only the calls bound to this version")
    p.add_argument(
        "--host",
        metavar="IP:PORT",
        help="only the calls this endpoint of the service serves, injected by its own sidecar "
        "(every caller sees that one host slow or failing)",
    )
    p.add_argument("--header", metavar="NAME=VALUE", help="only the calls carrying this header")
    p.add_argument("--delay", metavar="DURATION", help="a fixed delay, e.g. 500ms")
    p.add_argument("--abort-http", type=int, metavar="STATUS", help="abort with this HTTP status")
    p.add_argument("--abort-grpc", type=int, metavar="CODE", help="abort with this gRPC status")
    p.add_argument("--percent", type=float, default=100.0, help="share of the calls faulted")
    p.add_argument("--duration", help="remove it after this long, e.g. 2m (default: never)")
    add_admin_client_arguments(p)
    p.add_argument("--json", action="store_true", help="print the raw JSON reply")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for ACKs")


def spec(args: argparse.Namespace) -> dict[str, Any]:
    """The admin API's body for `add` (the mesh file's fields); ValueError naming the flag."""
    doc: dict[str, Any] = {"service": args.service}
    if args.version:
        doc["version"] = args.version
    if args.host:
        doc["host"] = args.host
    if args.header:
        name, sep, value = args.header.partition("=")
        if not sep or not name:
            raise ValueError(f"--header {args.header!r}: expected NAME=VALUE")
        doc["headers"] = {name: value}
    if args.delay:
        doc["delay"] = {"fixed_delay": args.delay, "percent": args.percent}
    if args.abort_http is not None and args.abort_grpc is not None:
        raise ValueError("--abort-http and --abort-grpc: give one")
    if args.abort_http is not None:
        doc["abort"] = {"http_status": args.abort_http, "percent": args.percent}
    if args.abort_grpc is not None:
        doc["abort"] = {"grpc_status": args.abort_grpc, "percent": args.percent}
    if args.duration:
        doc["duration"] = args.duration
    return doc


def run(args: argparse.Namespace) -> int:
    try:
        if args.action != "list" and not args.name:
            raise ValueError(f"{args.action} needs the fault's name")
        if args.action == "add" and not args.service:
            raise ValueError("add needs --service")
        body = spec(args) if args.action == "add" else None
        admin = AdminClient.from_args(args)
    except (ValueError, AdminError, TokenError) as e:
        print(f"meshlm fault: {e}", file=sys.stderr)
        return 2
    method = {"add": "POST", "list": "GET", "remove": "DELETE"}[args.action]
    path = "/v1/faults" + (f"/{quote(args.name, safe='')}" if args.name else "")
    path += f"?timeout={args.timeout:g}"
    try:
        code, reply = admin.request(method, path, body, timeout=args.timeout + 10)
    except AdminError as e:
        print(f"meshlm fault: {e}", file=sys.stderr)
        return 1
    if code >= 400 or not isinstance(reply, dict):
        print(f"meshlm fault: {failure(code, reply, admin)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(reply, indent=2))
    elif args.action == "list":
        for f in reply.get("faults") or []:
            print(fault_line(f))
        if not reply.get("faults"):
            print("no faults")
    else:
        print(
            f"fault {args.name} {'set' if args.action == 'add' else 'removed'}: {acked_line(reply)}"
        )
    return 0


def fault_line(f: dict[str, Any]) -> str:
    """One line per fault, for `list` and `meshlm status`."""
    scope = f["service"] + (f"/{f['version']}" if f.get("version") else "")
    scope += f" host {f['host']}" if f.get("host") else ""
    scope += "".join(f" {k}={v}" for k, v in (f.get("headers") or {}).items())
    what = []
    if f.get("delay"):
        what.append(f"delay {f['delay']['fixed_delay']} ({f['delay']['percent']:g}%)")
    if f.get("abort"):
        a = f["abort"]
        status = f"HTTP {a['http_status']}" if a.get("http_status") else f"gRPC {a['grpc_status']}"
        what.append(f"abort {status} ({a['percent']:g}%)")
    end = f.get("expires_at")
    until = f" until {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(end))}" if end else ""
    return f"{f['name']}: {scope}: {', '.join(what)}{until}"

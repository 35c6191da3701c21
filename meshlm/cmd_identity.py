"""`meshlm identity token|status|rotate-root`: the mesh CA through the control plane's admin API
(`/identity`, see xds_server/identity.py).

`token --service-account NS/SA` writes a join token file (0600) for one sidecar's first
certificate: `meshlm sidecar --identity --join-token-file FILE`. The token is single use and is
never printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from meshlm.admin_client import AdminClient, AdminError, add_admin_client_arguments
from sidecar.private_files import write_private
from xds_server.admin_token import TokenError

ACTIONS = ("token", "status", "rotate-root")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=ACTIONS, help="what to do: " + ", ".join(ACTIONS))
    add_admin_client_arguments(p)
    p.add_argument("--json", action="store_true", help="print the raw JSON reply (status)")
    p.add_argument("--timeout", type=float, default=30.0, help="HTTP timeout in seconds")
    t = p.add_argument_group("token")
    t.add_argument("--service-account", help="NAMESPACE/NAME the token grants")
    t.add_argument("--ttl", default="1h", help="how long the token can be used (default 1h)")
    t.add_argument("--out", help="the join token file to write, 0600 (default: "
                   "join-token-NAMESPACE-NAME.json here)")  # fmt: skip
    r = p.add_argument_group("rotate-root")
    r.add_argument("--activate-after", help="the new root signs after this (default: cert_ttl)")
    r.add_argument("--overlap", help="old roots stay trusted this long after (default: cert_ttl)")


def run(args: argparse.Namespace) -> int:
    try:
        admin = AdminClient.from_args(args)
    except (AdminError, TokenError) as e:
        print(f"meshlm identity: {e}", file=sys.stderr)
        return 2
    if args.action == "token":
        if not args.service_account:
            print("meshlm identity token: --service-account NAMESPACE/NAME is required",
                  file=sys.stderr)  # fmt: skip
            return 2
        method, path = "POST", "/identity/tokens"
        body: dict | None = {"service_account": args.service_account, "ttl": args.ttl}
    elif args.action == "rotate-root":
        method, path = "POST", "/identity/rotate-root"
        body = {k: v for k, v in (("activate_after", args.activate_after),
                                  ("overlap", args.overlap)) if v}  # fmt: skip
    else:
        method, path, body = "GET", "/identity", None
    try:
        code, reply = admin.request(method, path, body, args.timeout)
    except AdminError as e:
        print(f"meshlm identity: {e}", file=sys.stderr)
        return 1
    if code >= 400:
        err = reply.get("error", reply) if isinstance(reply, dict) else reply
        if code == 401:
            err = f"{err} (token: {admin.token_source})"
        elif code == 404 and args.action == "status":
            err = f"{err} (the mesh file has no identity block)"
        print(f"meshlm identity {args.action}: HTTP {code}: {err}", file=sys.stderr)
        return 1
    if args.action == "token":
        sa = reply["service_account"]
        out = Path(args.out or f"join-token-{sa.replace('/', '-')}.json")
        try:
            write_private(out, json.dumps(reply, indent=1).encode(), "a join token", any_dir=True)
        except OSError as e:
            print(f"meshlm identity token: --out {out}: {e.strerror or e}", file=sys.stderr)
            return 1
        until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(reply["expires_at"]))
        print(
            f"join token for {reply['spiffe_id']} written to {out} (mode 0600, single use, "
            f"until {until}); start the sidecar with --identity --join-token-file {out}"
        )
    elif args.json or args.action == "rotate-root":
        print(json.dumps(reply, indent=1))
    else:
        print(render(reply))
    return 0


def render(st: dict) -> str:
    lines = [
        f"trust domain {st['trust_domain']} ({st['mode']}), certificates for "
        f"{st['cert_ttl_s']:g}s, CA on {st['ca_address']} (mTLS renewals on "
        f"{st['ca_mtls_address']})",
        f"  issued {st['issued']}, refused {st['refused']}, join tokens unused "
        f"{st['join_tokens']['unused']}, used {st['join_tokens']['used']}",
    ]
    for r in st["roots"]:
        retire = f", retires {time.ctime(r['retire_at'])}" if r.get("retire_at") else ""
        lines.append(f"  root {r['sha256']} until {r['not_after']}{retire}")
    return "\n".join(lines)

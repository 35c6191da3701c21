"""`meshlm apply --mesh FILE`: push a changed mesh file (tenants, endpoints, resilience) to a
running control plane; returns once every affected sidecar ACKed, or names those that did not.
The live traffic split (weights, x-canary pins) stays with the weights API and rollouts."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from meshlm.cmd_rollout import add_admin_client_arguments
from xds_server.admin_token import TokenError, client_token


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", required=True, help="the mesh file (YAML)")
    add_admin_client_arguments(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for ACKs")


def run(args: argparse.Namespace) -> int:
    try:
        with open(args.mesh, "rb") as f:
            body = f.read()
        token, source = client_token(args.admin, args.token_file)
    except (OSError, TokenError) as e:
        print(f"meshlm apply: {e}", file=sys.stderr)
        return 2
    url = f"{args.admin.rstrip('/')}/v1/mesh?timeout={args.timeout:g}"
    req = urllib.request.Request(url, data=body, method="POST")
    req.add_header("Authorization", f"Bearer {token or ''}")
    try:
        with urllib.request.urlopen(req, timeout=args.timeout + 10) as r:
            reply = json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = json.loads(e.read() or b"{}")
        msg = detail.get("error") or f"not ACKed by {detail.get('missing')}: {detail.get('errors')}"
        if e.code == 401:
            msg += f" (token: {source})"
        print(f"meshlm apply: HTTP {e.code}: {msg}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"meshlm apply: cannot reach {args.admin}: {e}", file=sys.stderr)
        return 1
    print(
        f"applied version {reply['version']}, ACKed by {', '.join(reply['acked']) or 'no sidecar'}"
    )
    return 0

"""`meshlm apply --mesh FILE`: push a changed mesh file (tenants, endpoints, resilience) to a
running control plane; returns once every affected sidecar ACKed, or names those that did not.
The live traffic split (weights, x-canary pins) stays with the weights API and rollouts."""

from __future__ import annotations

import argparse
import sys

from meshlm.admin_client import AdminClient, AdminError, add_admin_client_arguments
from xds_server.admin_token import TokenError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", required=True, help="the mesh file (YAML)")
    add_admin_client_arguments(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for ACKs")


def run(args: argparse.Namespace) -> int:
    try:
        with open(args.mesh, "rb") as f:
            body = f.read()
        admin = AdminClient.from_args(args)
    except (OSError, AdminError, TokenError) as e:
        print(f"meshlm apply: {e}", file=sys.stderr)
        return 2
    path = f"/v1/mesh?timeout={args.timeout:g}"
    try:
        code, reply = admin.request("POST", path, body, timeout=args.timeout + 10)
    except AdminError as e:
        print(f"meshlm apply: {e}", file=sys.stderr)
        return 1
    if code >= 400 or not isinstance(reply, dict):
        detail = reply if isinstance(reply, dict) else {"error": reply}
        msg = detail.get("error") or f"not ACKed by {detail.get('missing')}: {detail.get('errors')}"
        if code == 401:
            msg += f" (token: {admin.token_source})"
        print(f"meshlm apply: HTTP {code}: {msg}", file=sys.stderr)
        return 1
    print(
        f"applied version {reply['version']}, ACKed by {', '.join(reply['acked']) or 'no sidecar'}"
    )
    return 0

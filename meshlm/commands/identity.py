"""`meshlm identity token|status|rotate-root`: the mesh CA through the control plane's admin API
(`/identity`, see xds_server/identity/workload.py).

`token --service-account NS/SA` writes a join token file (0600) for one sidecar's first
certificate: `meshlm sidecar --identity --join-token-file FILE`. The token is single use and is
never printed. Without `--out`, or with a bare file name, the file goes to the private run dir's
`join-tokens/` (never into the current folder, which may be a repository), where the sidecar
looks first for a bare --join-token-file name; `--out` with a directory part is used as given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from mesh_common.private_files import private_dir, write_private
from meshlm.admin_client import AdminClient, AdminError, add_admin_client_arguments
from xds_server.admin.token import TokenError, run_dir

ACTIONS = ("token", "status", "rotate-root")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=ACTIONS, help="what to do: " + ", ".join(ACTIONS))
    add_admin_client_arguments(p)
    p.add_argument("--json", action="store_true", help="print the raw JSON reply (status)")
    p.add_argument("--timeout", type=float, default=30.0, help="HTTP timeout in seconds")
    t = p.add_argument_group("token")
    t.add_argument("--service-account", help="NAMESPACE/NAME the token grants")
    t.add_argument("--ttl", default="1h", help="how long the token can be used (default 1h)")
    t.add_argument("--out", help="the join token file to write, 0600: a path as given; a "
                   "bare name goes to the private run dir's join-tokens/ (default: "
                   "join-token-NAMESPACE-NAME.json there)")  # fmt: skip
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
        out, as_given = token_file(args.out, sa)
        try:
            if not as_given:
                private_dir(out.parent, _KEPT)
            write_private(out, json.dumps(reply, indent=1).encode(), _KEPT, any_dir=as_given)
        except (OSError, ValueError) as e:  # PrivateFileError: a run dir that is not private
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            print(f"meshlm identity token: {out}: {reason}", file=sys.stderr)
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


_KEPT = "join tokens"  # what the dir holds, for its errors
TOKENS_DIR = "join-tokens"


def token_file(out: str | None, service_account: str) -> tuple[Path, bool]:
    """(the join token file to write, whether it is a path the user gave as it is)."""
    if out and (os.sep in out or out in (".", "..")):
        return Path(out), True
    return run_dir() / TOKENS_DIR / (
        out or f"join-token-{service_account.replace('/', '-')}.json"
    ), False


def find_token_file(given: str) -> str:
    """A --join-token-file bare name: the run dir's file of that name (where `token --out NAME`
    writes it) if there is one, else the name in the current folder."""
    if os.sep in given or given in (".", ".."):
        return given
    kept = run_dir() / TOKENS_DIR / given
    return str(kept) if kept.exists() else given


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

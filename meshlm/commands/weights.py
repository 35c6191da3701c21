"""`meshlm weights SERVICE v1=80 v2=20`: set a service's traffic split through the control
plane's admin API (POST /v1/services/SERVICE/weights); returns once every affected sidecar ACKed,
or names those that did not, as the API does. Weights that send traffic to a version with no
endpoint in the mesh are refused unless --force; to one with no live endpoint they are set, with
a warning."""

from __future__ import annotations

import argparse
import sys
from urllib.parse import quote

from meshlm.admin_client import AdminClient, AdminError, add_admin_client_arguments
from meshlm.commands.apply import acked_line, failure
from xds_server.admin.token import TokenError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("service", help="the mesh service, e.g. llm")
    p.add_argument(
        "weights",
        nargs="+",
        metavar="VERSION=WEIGHT",
        help="every version of the service with its weight (integers; they need not sum to 100)",
    )
    add_admin_client_arguments(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for ACKs")
    p.add_argument(
        "--force",
        action="store_true",
        help="set the weights even where a version given traffic has no endpoint in the mesh",
    )


def parse_weights(items: list[str]) -> dict[str, int]:
    """{"v1": 80, "v2": 20} from ["v1=80", "v2=20"]; ValueError naming the bad item."""
    weights: dict[str, int] = {}
    for item in items:
        version, sep, value = item.partition("=")
        if not sep or not version or not value.strip().isdigit():
            raise ValueError(f"{item!r}: expected VERSION=WEIGHT with a whole number, e.g. v1=80")
        if version in weights:
            raise ValueError(f"{item!r}: version {version!r} given twice")
        weights[version] = int(value)
    return weights


def run(args: argparse.Namespace) -> int:
    try:
        weights = parse_weights(args.weights)
        admin = AdminClient.from_args(args)
    except (ValueError, AdminError, TokenError) as e:
        print(f"meshlm weights: {e}", file=sys.stderr)
        return 2
    path = f"/v1/services/{quote(args.service, safe='')}/weights?timeout={args.timeout:g}"
    path += "&force=1" if args.force else ""
    try:
        code, reply = admin.request("POST", path, weights, timeout=args.timeout + 10)
    except AdminError as e:
        print(f"meshlm weights: {e}", file=sys.stderr)
        return 1
    if code >= 400 or not isinstance(reply, dict):
        print(f"meshlm weights: {failure(code, reply, admin)}", file=sys.stderr)
        return 1
    for warning in reply.get("warnings") or []:
        print(f"meshlm weights: warning: {warning}", file=sys.stderr)
    split = " ".join(f"{v}={w}" for v, w in weights.items())
    if reply.get("changed") is False:
        print(f"{args.service}: {split}: {acked_line(reply)}")
    else:
        print(f"{args.service}: {split} (version {reply.get('version')}), {acked_line(reply)}")
    return 0

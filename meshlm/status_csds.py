"""`meshlm status --csds HOST:PORT`: the same sync status read over CSDS from the control
plane's ADS port, as `istioctl proxy-status` reads it. The admin API stays the
default: it needs no certificate, while a mesh with identity serves ADS (and so CSDS) over
mTLS only, which takes a mesh certificate (--cert/--key, --cacert for the root)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import grpc
from envoy.admin.v3 import config_dump_shared_pb2 as cd
from envoy.service.status.v3 import csds_pb2, csds_pb2_grpc
from google.protobuf import json_format

from mesh_common import type_urls as t
from meshlm.logs import escape
from xds_server.identity.ca import CA_SERVER_NAME

ORDER = ("CDS", "EDS", "LDS", "ECDS", "RDS")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--csds", metavar="HOST:PORT", help="read CSDS from the control plane's ADS "
                   "port instead of the admin API")  # fmt: skip
    p.add_argument("--cert", help="with --csds on a mesh with identity: PEM certificate chain "
                   "of a mesh identity (a sidecar's) to present")  # fmt: skip
    p.add_argument("--key", help="with --csds: the private key (PEM) of --cert")


def _channel(target: str, args: argparse.Namespace) -> grpc.Channel:
    if not (args.cert or args.key):
        return grpc.insecure_channel(target)
    if not (args.cert and args.key and args.cacert):
        raise ValueError("--cert, --key and --cacert go together (mTLS to the ADS port)")
    with open(args.cert, "rb") as c, open(args.key, "rb") as k, open(args.cacert, "rb") as r:
        creds = grpc.ssl_channel_credentials(r.read(), k.read(), c.read())
    # The ADS port's certificate names the CA's server name, not an address
    # (xds_server/identity/ca.py).
    override = [("grpc.ssl_target_name_override", CA_SERVER_NAME)]
    return grpc.secure_channel(target, creds, options=override)


def show(args: argparse.Namespace) -> int:
    """Print one table; 1 when CSDS cannot be read."""
    try:
        with _channel(args.csds, args) as channel:
            stub = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(channel)
            req = csds_pb2.ClientStatusRequest(exclude_resource_contents=True)
            resp = stub.FetchClientStatus(req, timeout=10)
    except (OSError, ValueError) as e:
        print(f"meshlm status: {e}", file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        print(f"meshlm status: CSDS {args.csds}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json_format.MessageToJson(resp, indent=1))
    else:
        print(render(resp))
    return 0


def render(resp: csds_pb2.ClientStatusResponse) -> str:
    """One row per sidecar and type: how many resources, their version, the status of the
    least synced one (config status/client status) and a NACK's error."""
    rows = [("NODE", "TYPE", "RESOURCES", "VERSION", "STATUS", "ERROR")]
    for config in resp.config:
        by_type: dict[str, list] = {}
        for g in config.generic_xds_configs:
            by_type.setdefault(t.SHORT.get(g.type_url, g.type_url), []).append(g)
        for short in sorted(by_type, key=lambda s: ORDER.index(s) if s in ORDER else 99):
            gs = by_type[short]
            worst = max(gs, key=lambda g: (g.config_status != csds_pb2.SYNCED, g.config_status))
            statuses = Counter(
                f"{csds_pb2.ConfigStatus.Name(g.config_status)}/"
                f"{cd.ClientResourceStatus.Name(g.client_status)}"
                for g in gs
            )
            status = ",".join(sorted(statuses))
            err = escape(worst.error_state.details)
            rows.append((config.node.id, short, str(len(gs)), worst.version_info, status, err))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join(
        ("  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + "  " + r[5]).rstrip()
        for r in rows
    )

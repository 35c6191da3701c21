"""`meshlm apply --mesh FILE`: push a changed mesh file (tenants, endpoints, resilience) to a
running control plane; returns once every affected sidecar ACKed, or names those that did not.
The live traffic split (weights, x-canary pins) stays with the weights API and rollouts: the
file's `route.weights` of a service whose versions did not change are not applied, and apply
says so for each one that differs from the split in force, with the command that applies it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from meshlm.admin_client import AdminClient, AdminError, add_admin_client_arguments
from xds_server.admin.token import TokenError
from xds_server.mesh import MeshError, load_yaml, parse_mesh
from xds_server.resources.names import outbound_cluster


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", required=True, help="the mesh file (YAML)")
    add_admin_client_arguments(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for ACKs")


def failure(code: int, reply: Any, admin: AdminClient) -> str:
    """One line for an admin API change that failed (HTTP `code`, JSON `reply`)."""
    detail = reply if isinstance(reply, dict) else {"error": reply}
    msg = detail.get("error") or f"not ACKed by {detail.get('missing')}: {detail.get('errors')}"
    if code == 401:
        msg += f" (token: {admin.token_source})"
    return f"HTTP {code}: {msg}"


def run(args: argparse.Namespace) -> int:
    try:
        with open(args.mesh, "rb") as f:
            body = f.read()
        load_yaml(body, args.mesh)  # YAML errors name this file here, not the request body
        admin = AdminClient.from_args(args)
    except (OSError, AdminError, TokenError, MeshError) as e:
        print(f"meshlm apply: {e}", file=sys.stderr)
        return 2
    path = f"/v1/mesh?timeout={args.timeout:g}"
    try:
        code, reply = admin.request("POST", path, body, timeout=args.timeout + 10)
    except AdminError as e:
        print(f"meshlm apply: {e}", file=sys.stderr)
        return 1
    if code >= 400 or not isinstance(reply, dict):
        print(f"meshlm apply: {failure(code, reply, admin)}", file=sys.stderr)
        return 1
    if reply.get("changed") is False:
        print(acked_line(reply))
    else:
        print(f"applied version {reply['version']}, {acked_line(reply)}")
    for line in not_applied(body, admin):
        print(line)
    return 0


def acked_line(reply: dict[str, Any]) -> str:
    """What a change's reply says: nothing changed, or which sidecars ACKed it."""
    if reply.get("changed") is False:
        return f"nothing changed: the control plane already held this (version {reply['version']})"
    acked = ", ".join(reply.get("acked") or []) or "no sidecar (none it touches is connected)"
    return f"ACKed by {acked}"


def not_applied(body: bytes, admin: AdminClient) -> list[str]:
    """A line per service whose file weights differ from the split the control plane kept."""
    try:
        mesh = parse_mesh(load_yaml(body, "mesh"))
        code, dump = admin.request("GET", "/debug/config_dump", timeout=10)
    except (ValueError, AdminError):  # the control plane took it: nothing to say then
        return []
    live = live_weights(dump) if code == 200 else {}
    lines = []
    for name, svc in sorted(mesh.services.items()):
        wanted = dict(svc.route.weights)
        clusters = {outbound_cluster(name, v): v for v in wanted}
        kept = live.get(name)
        if kept is None or set(kept) != set(clusters):
            continue  # versions changed: the file's weights were applied
        kept_split = {clusters[c]: w for c, w in kept.items()}
        if kept_split == wanted:
            continue
        fmt = " ".join(f"{v}={w}" for v, w in wanted.items())
        lines.append(
            f"not applied: services.{name}.route.weights ({fmt}): the live split "
            f"{' '.join(f'{v}={w}' for v, w in kept_split.items())} stays, as weights belong to "
            f"rollouts and the weights API; to apply the file's: meshlm weights {name} {fmt}"
        )
    return lines


def live_weights(dump: Any) -> dict[str, dict[str, int]]:
    """service -> {cluster: weight} of its weighted route in a /debug/config_dump reply."""
    out: dict[str, dict[str, int]] = {}
    for group in dump.get("groups", []) if isinstance(dump, dict) else []:
        for rc in group.get("types", {}).get("RDS", {}).get("resources", {}).values():
            for vh in rc.get("virtualHosts", []):
                for route in vh.get("routes", []):
                    if route.get("name") != f"{vh.get('name')}-weighted":
                        continue
                    clusters = route.get("route", {}).get("weightedClusters", {}).get("clusters")
                    out[vh["name"]] = {c["name"]: int(c.get("weight", 0)) for c in clusters or []}
    return out

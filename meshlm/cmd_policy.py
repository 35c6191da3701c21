"""`meshlm policy compile|test|hash`: the authz policy of a mesh file, compiled or tried out.

`test` runs the real authz.wasm in the Python proxy-wasm host, so its answer is the filter's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from wasm_filters.policy import Policy, PolicyError, compile_filter_config, hash_key, parse_policy
from xds_server.mesh import MeshError, load_yaml

GRPC_NAMES = {
    0: "OK",
    7: "PERMISSION_DENIED",
    8: "RESOURCE_EXHAUSTED",
    14: "UNAVAILABLE",
    16: "UNAUTHENTICATED",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    c = sub.add_parser("compile", help="print the filter configuration for one service")
    c.add_argument("--mesh", required=True, type=Path, help="mesh file (YAML)")
    c.add_argument("--service", default="llm", help="service the sidecar guards (default llm)")
    t = sub.add_parser("test", help="run one request through the real filter")
    t.add_argument("--mesh", required=True, type=Path)
    t.add_argument("--service", default="llm")
    t.add_argument("--key", default="", help="API key sent as x-api-key (empty: none)")
    t.add_argument("--path", default="/meshlm.inference.v1.Inference/Generate")
    t.add_argument("--http", action="store_true", help="send as plain HTTP, not gRPC")
    h = sub.add_parser("hash", help="print the key_sha256 of an API key read from stdin")
    h.set_defaults(mesh=None)


def load_policy(mesh: Path) -> Policy:
    """The policy of a mesh file (its `tenants:` and optional `roles:`)."""
    raw: Any = load_yaml(mesh.read_text(), source=str(mesh))
    if not isinstance(raw, dict):
        raise PolicyError(f"{mesh}: not a mapping")
    return parse_policy(raw.get("tenants"), roles=raw.get("roles"))


def run(args: argparse.Namespace) -> int:
    if args.action == "hash":
        print(hash_key(sys.stdin.readline().rstrip("\r\n")))
        return 0
    try:
        policy = load_policy(args.mesh)
        config = compile_filter_config(policy, service=args.service)
    except (OSError, MeshError, PolicyError) as e:
        print(f"meshlm policy: {e}", file=sys.stderr)
        return 2
    if args.action == "compile":
        print(json.dumps(json.loads(config), indent=2))
        return 0
    from wasm_filters.host import WasmHost

    host = WasmHost()
    if not host.configure(config):
        print("meshlm policy: the filter refused the configuration", file=sys.stderr)
        return 1
    headers = {"x-api-key": args.key} if args.key else {}
    d = host.request(headers, path=args.path, grpc=not args.http)
    out = {
        "decision": "allow" if d.allowed else "deny",
        "status": 200 if d.allowed else d.status,
        "grpc_status": None if args.http else GRPC_NAMES.get(d.grpc_status or 0),
        "tenant": (d.header("x-meshlm-tenant") or b"").decode() or None,
        "priority": (d.header("x-meshlm-priority") or b"").decode() or None,
        "message": d.body.decode(errors="replace") or None,
    }
    print(json.dumps(out, indent=2))
    return 0 if d.allowed else 1

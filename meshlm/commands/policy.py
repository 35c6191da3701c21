"""`meshlm policy compile|test|hash`: the authz policy of a mesh file, compiled or tried out.

`test` runs the real authz.wasm in the Python proxy-wasm host, so its answer is the filter's,
and explains it from the filter's own counters: which workload rule (`--principal`, the
caller's SPIFFE ID) and which tenant check allowed or denied the call.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mesh_common.headers import API_KEY_HEADER, PRIORITY_HEADER, TENANT_HEADER
from wasm_filters.policy import (
    CallerRule,
    Policy,
    PolicyError,
    compile_filter_config,
    hash_key,
    parse_policy,
)
from xds_server.mesh import MeshError, load_yaml
from xds_server.mesh import callers as mesh_callers

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
    t.add_argument("--mesh", required=True, type=Path, help="mesh file (YAML)")
    t.add_argument("--service", default="llm", help="service the sidecar guards")
    t.add_argument("--key", default="", help="API key sent as x-api-key (empty: none)")
    t.add_argument("--path", default="/meshlm.inference.v1.Inference/Generate", help="request path")
    t.add_argument("--http", action="store_true", help="send as plain HTTP, not gRPC")
    t.add_argument(
        "--principal",
        default=None,
        help="the caller's SPIFFE ID, as its mTLS certificate says (default: a plaintext caller)",
    )
    h = sub.add_parser("hash", help="print the key_sha256 of an API key read from stdin")
    h.set_defaults(mesh=None)


def load_policy(mesh: Path) -> Policy:
    """The policy of a mesh file (its `tenants:` and optional `roles:`)."""
    raw = _raw(mesh)
    return parse_policy(raw.get("tenants"), roles=raw.get("roles"))


def _raw(mesh: Path) -> dict:
    raw: Any = load_yaml(mesh.read_text(), source=str(mesh))
    if not isinstance(raw, dict):
        raise PolicyError(f"{mesh}: not a mapping")
    return raw


def filter_config(mesh: Path, service: str) -> bytes:
    """The filter configuration a control plane pushes to `service`'s sidecars: tenants, and
    with identity on, the caller's SPIFFE ID and the service's `callers` rules."""
    raw = _raw(mesh)
    policy = load_policy(mesh)
    identity, callers = mesh_callers.raw_callers(raw, service)
    if identity is None or identity.mtls == "off":
        return compile_filter_config(policy, service=service)
    rules = None
    if callers is not None:
        rules = [CallerRule(*r) for r in mesh_callers.rules(identity.trust_domain, callers)]
    return compile_filter_config(policy, service=service, peer_identity=True, callers=rules)


def run(args: argparse.Namespace) -> int:
    if args.action == "hash":
        print(hash_key(sys.stdin.readline().rstrip("\r\n")))
        return 0
    try:
        config = filter_config(args.mesh, args.service)
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
    headers = {API_KEY_HEADER: args.key} if args.key else {}
    before = dict(host.metrics)
    d = host.request(headers, path=args.path, grpc=not args.http, principal=args.principal)
    counted = [n for n, v in host.metrics.items() if v > before.get(n, 0)]
    out = {
        "decision": "allow" if d.allowed else "deny",
        "status": 200 if d.allowed else d.status,
        "grpc_status": None if args.http else GRPC_NAMES.get(d.grpc_status or 0),
        "tenant": (d.header(TENANT_HEADER) or b"").decode() or None,
        "priority": (d.header(PRIORITY_HEADER) or b"").decode() or None,
        "message": d.body.decode(errors="replace") or None,
        "workload": _workload(json.loads(config), args.principal, counted),
        "tenant_check": _tenant_check(counted),
    }
    print(json.dumps(out, indent=2))
    return 0 if d.allowed else 1


_CALLER = "meshlm_authz.caller."


def _workload(config: dict, principal: str | None, counted: list[str]) -> dict:
    """The workload half of the decision, from the counters the filter bumped."""
    out: dict[str, Any] = {"principal": principal}
    if not config.get("peer_identity"):
        out["check"] = "none (the mesh has no identity: plaintext, no caller is known)"
        return out
    if "callers" not in config:
        out["check"] = "none (no callers rule: any workload of the trust domain)"
        return out
    for name in counted:
        if name.startswith(_CALLER + "allowed."):
            out.update(check="allow", rule=name[len(_CALLER + "allowed.") :])
        elif name.startswith(_CALLER + "denied."):
            rule = name[len(_CALLER + "denied.") :]
            out.update(check="deny", rule=rule, why=f"rule {rule} does not allow this method")
        elif name == "meshlm_authz.denied.unknown_caller":
            why = "no certificate (plaintext)" if principal is None else "no rule names it"
            out.update(check="deny", rule=None, why=why)
    return out


def _tenant_check(counted: list[str]) -> str:
    """The tenant half: allowed, missing_key, unknown_key, forbidden, rate_limited, or not
    reached (the workload check denied first)."""
    for name in counted:
        for prefix in ("meshlm_authz.allowed.", "meshlm_authz.denied."):
            if name.startswith(prefix) and "caller" not in name:
                return (
                    "allowed" if prefix.endswith("allowed.") else name[len(prefix) :].split(".")[0]
                )
    return "not reached"

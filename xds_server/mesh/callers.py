"""Which workloads may call a service: `services.<name>.callers`.

    services:
      llm:
        callers:
          - {service_account: apps/chat}                       # every method
          - {service_account: batch/*, methods: [Generate]}    # any account of namespace batch

Absent: any workload of the trust domain may call (Istio's default with mTLS on); present and
empty: nobody. A workload is known by the SPIFFE ID of its certificate,
`spiffe://<trust domain>/ns/<namespace>/sa/<name>`, so `callers` needs an `identity` block with
mTLS on. Tenant keys still apply: a call passes when both allow it. The rules compile to Envoy
RBAC (xds_server/resources/rbac.py) and into the Wasm authz filter's configuration.
"""

from __future__ import annotations

import re
from typing import Any

from xds_server.mesh.fields import MeshError, only_known, read_mapping
from xds_server.mesh.identity import parse_identity
from xds_server.mesh.model import METHODS, Caller, Identity, Service

# The inference API's gRPC path prefix (schemas/inference.fbs; wasm_filters.policy has it too).
METHOD_PREFIX = "/meshlm.inference.v1.Inference/"
# A listed caller may always ask for health: its sidecar's active health checks go this way.
HEALTH_PATHS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")

_SEGMENT = r"[a-zA-Z0-9][a-zA-Z0-9_.-]*"
CALLER_ACCOUNT = re.compile(rf"^{_SEGMENT}/(?:{_SEGMENT}|\*)\Z")


def parse_callers(raw: Any, path: str) -> tuple[Caller, ...] | None:
    """`[{service_account: NS/NAME | NS/*, methods: [Method, ...]}, ...]`; None when absent."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise MeshError(f"{path}: expected a list of {{service_account, methods}}, got {raw!r}")
    out: list[Caller] = []
    for i, item in enumerate(raw):
        where = f"{path}[{i}]"
        d = read_mapping(item, where)
        only_known(d, where, {"service_account", "methods"})
        sa = d.get("service_account")
        if not isinstance(sa, str) or not CALLER_ACCOUNT.match(sa):
            raise MeshError(
                f"{where}.service_account: expected NAMESPACE/NAME or NAMESPACE/*, got {sa!r}"
            )
        if any(c.service_account == sa for c in out):
            raise MeshError(f"{where}.service_account: {sa} is listed twice")
        out.append(Caller(service_account=sa, methods=_methods(d.get("methods"), where)))
    return tuple(out)


def _methods(raw: Any, path: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise MeshError(f"{path}.methods: expected a non-empty list of methods (omit: all)")
    for j, meth in enumerate(raw):
        if meth not in METHODS:
            raise MeshError(
                f"{path}.methods[{j}]: unknown method {meth!r} (methods: {', '.join(METHODS)})"
            )
    return tuple(dict.fromkeys(raw))


def check_callers(services: dict[str, Service], identity: Identity | None) -> None:
    """`callers` names workloads by their certificates: it needs identity with mTLS on."""
    for svc in services.values():
        _check(svc.name, svc.callers, identity)


def _check(service: str, callers: tuple[Caller, ...] | None, identity: Identity | None) -> None:
    if callers is None:
        return
    if identity is None:
        raise MeshError(
            f"services.{service}.callers: needs an `identity` block (workloads are known by "
            "their mTLS certificates)"
        )
    if identity.mtls == "off":
        raise MeshError(
            f"services.{service}.callers: needs mTLS, but identity.mtls is off (no caller "
            "would present a certificate)"
        )


def principal(trust_domain: str, caller: Caller) -> str:
    """The caller's SPIFFE ID; for `NS/*` the prefix of the namespace's IDs followed by `*`."""
    ns, name = caller.service_account.split("/", 1)
    return f"spiffe://{trust_domain}/ns/{ns}/sa/{name}"


def paths(caller: Caller) -> tuple[str, ...] | None:
    """The gRPC paths the caller may request: its methods and health; None: any path."""
    if not caller.methods:
        return None
    return (*(METHOD_PREFIX + m for m in caller.methods), *HEALTH_PATHS)


def rules(
    trust_domain: str, callers: tuple[Caller, ...]
) -> list[tuple[str, str, tuple[str, ...] | None]]:
    """(name, principal, paths) per caller: the Wasm authz filter's `callers` rules."""
    return [(c.service_account, principal(trust_domain, c), paths(c)) for c in callers]


def raw_callers(raw_mesh: Any, service: str) -> tuple[Identity | None, tuple[Caller, ...] | None]:
    """(identity, callers of `service`) from an unvalidated mesh file, reading only those
    fields (for `meshlm policy`, which takes a partial mesh); MeshError names the field."""
    top = read_mapping(raw_mesh, "mesh")
    svc = read_mapping(
        read_mapping(top.get("services"), "services").get(service), f"services.{service}"
    )
    callers = parse_callers(svc.get("callers"), f"services.{service}.callers")
    raw_identity = top.get("identity")
    identity = (
        None if raw_identity is None else parse_identity(read_mapping(raw_identity, "identity"))
    )
    _check(service, callers, identity)
    return identity, callers

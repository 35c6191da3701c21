"""The mesh file (YAML) -> `Mesh`: the top level, services, versions, routes and rollouts.

Every error is a `MeshError` whose message starts with the field path, e.g.
`services.llm.route.weights.v3: unknown version (known: v1, v2)`."""

from __future__ import annotations

import fnmatch
import importlib
from pathlib import Path
from typing import Any

from mesh_common.headers import CANARY_HEADER
from xds_server.mesh.callers import check_callers, parse_callers
from xds_server.mesh.faults import parse_faults
from xds_server.mesh.fields import (
    MeshError,
    check_name,
    load_yaml,
    only_known,
    parse_duration,
    read_int,
    read_mapping,
    read_optional,
    read_optional_port,
    read_port,
    read_positive,
    read_url,
)
from xds_server.mesh.identity import SERVICE_ACCOUNT, parse_identity
from xds_server.mesh.locality import parse_locality
from xds_server.mesh.model import (
    ACCESS_LOG_CALLS,
    AUTHZ_MODES,
    HASH_BALANCE_FACTOR,
    LOAD_BALANCING,
    METHODS,
    RATE_LIMIT_MODES,
    AccessLog,
    Authz,
    CallerSidecar,
    ControlPlaneConfig,
    HashPolicy,
    Mesh,
    RateLimits,
    Rollout,
    Route,
    Service,
    Version,
    check_weights,
)
from xds_server.mesh.registration import parse_registration
from xds_server.mesh.resilience import (
    parse_circuit_breakers,
    parse_health_check,
    parse_isolation,
    parse_outlier_detection,
    parse_retry_policy,
    parse_slo,
    parse_stall,
)
from xds_server.mesh.rollout_spec import RolloutSpecError, parse_rollout
from xds_server.mesh.served_models import check_unique_across, parse_model_names
from xds_server.mesh.zoned_endpoint import parse_zoned_endpoint


def load_mesh(path: str | Path) -> Mesh:
    return parse_mesh(load_yaml(Path(path).read_text(), str(path)))


def parse_mesh(raw: Any) -> Mesh:
    top = read_mapping(raw, "mesh")
    only_known(
        top,
        "mesh",
        {
            "control_plane",
            "services",
            "tenants",
            "roles",
            "rollouts",
            "authz",
            "access_log",
            "rate_limits",
            "caller_sidecars",
            "identity",
            "default_service",
            "faults",
        },
    )
    services_raw = read_mapping(top.get("services"), "services")
    if not services_raw:
        raise MeshError("services: at least one service is required")
    services = {n: _service(n, v, f"services.{n}") for n, v in services_raw.items()}
    check_unique_across(services)
    tenants = _tenants(top.get("tenants"), top.get("roles"))
    if tenants is not None:
        _check_allow_rules(top.get("tenants"), top.get("roles"), services)
    authz_raw = read_mapping(top.get("authz", {}), "authz")
    only_known(authz_raw, "authz", {"mode", "keys_file"})
    mode = authz_raw.get("mode", "wasm" if tenants else "none")
    if mode not in AUTHZ_MODES:
        raise MeshError(f"authz.mode: expected one of {', '.join(AUTHZ_MODES)}, got {mode!r}")
    if mode != "none" and not tenants:
        raise MeshError(f"authz.mode: {mode} needs a tenants section")
    keys_file = authz_raw.get("keys_file")
    if mode == "native" and not isinstance(keys_file, str):
        raise MeshError("authz.keys_file: native mode needs a file of plaintext keys per tenant")
    _check_token_budgets(tenants, mode)
    rollouts_raw = read_mapping(top.get("rollouts", {}), "rollouts")
    rollouts = {n: _rollout(n, v, services, f"rollouts.{n}") for n, v in rollouts_raw.items()}
    identity = read_optional(top, "identity", "mesh", lambda d, _p: parse_identity(d))
    check_callers(services, identity)
    return Mesh(
        services=services,
        control_plane=_control_plane(top.get("control_plane", {})),
        tenants=tenants,
        rollouts=rollouts,
        authz=Authz(mode=mode, keys_file=keys_file if mode == "native" else None),
        access_log=_access_log(top.get("access_log", True)),
        rate_limits=_rate_limits(top.get("rate_limits")),
        caller_sidecars=_caller_sidecars(top.get("caller_sidecars")),
        identity=identity,
        default_service=_default_service(top.get("default_service"), services),
        faults=parse_faults(top.get("faults"), services),
    )


def _check_token_budgets(tenants: Any, authz_mode: str) -> None:
    """Token budgets reach a runtime only as the header the Wasm authz filter sets."""
    for t in getattr(tenants, "tenants", ()):
        if t.token_budget is not None and authz_mode != "wasm":
            raise MeshError(
                f"tenants.{t.name}.token_budget: needs authz.mode wasm (its filter hands the "
                f"runtime each tenant's budget), not {authz_mode}"
            )


def _default_service(raw: Any, services: dict[str, Service]) -> str | None:
    """`default_service: llm`: where a caller sidecar sends an OpenAI call (/v1/) whose Host
    names no service (the openai SDK sends the model name in the body, not a Host)."""
    if raw is None:
        return None
    if not isinstance(raw, str) or raw not in services:
        raise MeshError(
            f"default_service: expected the name of a service of this mesh "
            f"({', '.join(services)}), got {raw!r}"
        )
    return raw


def _caller_sidecars(raw: Any) -> tuple[CallerSidecar, ...]:
    """`caller_sidecars: [{admin_url: http://127.0.0.1:15000}, ...]`."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise MeshError("caller_sidecars: expected a list of {admin_url: URL}")
    out = []
    for i, item in enumerate(raw):
        path = f"caller_sidecars[{i}]"
        d = read_mapping(item, path)
        only_known(d, path, {"admin_url"})
        out.append(CallerSidecar(admin_url=read_url(d.get("admin_url"), f"{path}.admin_url")))
    if len({c.admin_url for c in out}) != len(out):
        raise MeshError("caller_sidecars: duplicate admin_url")
    return tuple(out)


def _check_allow_rules(tenants: dict, roles: Any, services: dict[str, Service]) -> None:
    """Each allow rule must match a service of this mesh and one of its methods (the policy
    model checked the rules' shape already)."""
    rules = [
        (f"tenants.{t}.allow[{i}]", p)
        for t, v in tenants.items()
        for i, p in enumerate(v.get("allow") or [])
    ]
    rules += [(f"roles.{r}[{i}]", p) for r, ps in (roles or {}).items() for i, p in enumerate(ps)]
    for path, pattern in rules:
        svc, method = pattern.split("/", 1)
        if not any(fnmatch.fnmatchcase(s, svc) for s in services):
            raise MeshError(
                f"{path}: {pattern!r} matches no service (services: {', '.join(services)})"
            )
        if not any(fnmatch.fnmatchcase(m, method) for m in METHODS):
            raise MeshError(
                f"{path}: {pattern!r} matches no method (methods: {', '.join(METHODS)})"
            )


def _access_log(raw: Any) -> AccessLog:
    """`access_log: false` (off), `true` / `{}` (stdout, the default) or `{path: FILE}`, and
    which calls each side logs: `{outbound: all, inbound: failures}` (the default)."""
    if isinstance(raw, bool):
        return AccessLog(enabled=raw)
    d = read_mapping(raw, "access_log")
    only_known(d, "access_log", {"path", "outbound", "inbound"})
    path = d.get("path")
    if path is not None and (not isinstance(path, str) or not path):
        raise MeshError(f"access_log.path: expected a file path, got {path!r}")
    sides = {}
    for side in ("outbound", "inbound"):
        calls = d.get(side, getattr(AccessLog, side))
        if calls is False:  # YAML 1.1 reads a bare `off` as false
            calls = "off"
        if calls not in ACCESS_LOG_CALLS:
            raise MeshError(
                f"access_log.{side}: expected one of {', '.join(ACCESS_LOG_CALLS)}, got {calls!r}"
            )
        sides[side] = calls
    return AccessLog(path=path, **sides)


def _rate_limits(raw: Any) -> RateLimits:
    d = read_mapping(raw, "rate_limits")
    only_known(d, "rate_limits", {"mode"})
    mode = d.get("mode", "local")
    if mode not in RATE_LIMIT_MODES:
        raise MeshError(
            f"rate_limits.mode: expected one of {', '.join(RATE_LIMIT_MODES)}, got {mode!r}"
        )
    return RateLimits(mode=mode)


def _tenants(raw: Any, roles: Any) -> Any:
    if raw is None:
        if roles is not None:
            raise MeshError("roles: needs a tenants section")
        return None
    raw = read_mapping(raw, "tenants")
    try:
        policy = importlib.import_module("wasm_filters.policy")
    except ModuleNotFoundError:
        return raw  # the policy model is not installed: keep the raw section
    try:
        return policy.parse_policy(raw, path="tenants", roles=roles, roles_path="roles")
    except ValueError as e:  # wasm_filters.policy.PolicyError names the field itself
        raise MeshError(str(e)) from None


def _control_plane(raw: Any) -> ControlPlaneConfig:
    d = read_mapping(raw, "control_plane")
    only_known(
        d,
        "control_plane",
        {
            "grpc_port",
            "admin_port",
            "debounce",
            "lagging_after",
            "ca_port",
            "ca_mtls_port",
            "registration",
        },
    )
    lagging_after = parse_duration(d.get("lagging_after", "30s"), "control_plane.lagging_after")
    if lagging_after <= 0:  # 0 would count every change as applied before any ACK
        raise MeshError("control_plane.lagging_after: must be more than 0s")
    return ControlPlaneConfig(
        grpc_port=read_port(d.get("grpc_port", 18000), "control_plane.grpc_port", allow_zero=True),
        admin_port=read_port(
            d.get("admin_port", 18001), "control_plane.admin_port", allow_zero=True
        ),
        debounce=parse_duration(d.get("debounce", "100ms"), "control_plane.debounce"),
        lagging_after=lagging_after,
        ca_port=read_optional_port(d, "ca_port"),
        ca_mtls_port=read_optional_port(d, "ca_mtls_port"),
        registration=parse_registration(d.get("registration")),
    )


def _service(name: str, raw: Any, path: str) -> Service:
    check_name(name, path)
    if name.endswith("-shadow"):
        # Envoy's request mirroring names a copy `<service>-shadow`: the inbound
        # sidecars treat such an authority as a mirrored copy, never a service's own calls.
        raise MeshError(f"{path}: a service name must not end in -shadow (mirrored copies' own)")
    d = read_mapping(raw, path)
    only_known(
        d,
        path,
        {
            "versions",
            "route",
            "outlier_detection",
            "circuit_breakers",
            "retry_policy",
            "health_check",
            "connect_timeout",
            "stall",
            "load_balancing",
            "hash_balance_factor",
            "slo",
            "isolation",
            "service_account",
            "callers",
            "locality",
            "model",
            "aliases",
        },
    )
    model, aliases = parse_model_names(d, path)
    vraw = read_mapping(d.get("versions"), f"{path}.versions")
    if not vraw:
        raise MeshError(f"{path}.versions: at least one version is required")
    versions = {v: _version(v, x, f"{path}.versions.{v}") for v, x in vraw.items()}
    route = _route(d.get("route"), versions, f"{path}.route")
    lb = _load_balancing(d.get("load_balancing"), route, f"{path}.load_balancing")
    return Service(
        name=name,
        versions=versions,
        route=route,
        load_balancing=lb,
        hash_balance_factor=_hash_balance_factor(d.get("hash_balance_factor"), lb, path),
        slo=read_optional(d, "slo", path, parse_slo),
        outlier_detection=read_optional(d, "outlier_detection", path, parse_outlier_detection),
        circuit_breakers=read_optional(d, "circuit_breakers", path, parse_circuit_breakers),
        retry_policy=read_optional(d, "retry_policy", path, parse_retry_policy),
        health_check=read_optional(d, "health_check", path, parse_health_check),
        stall=read_optional(d, "stall", path, parse_stall),
        isolation=read_optional(d, "isolation", path, lambda i, p: parse_isolation(i, p, route)),
        connect_timeout=read_positive(d.get("connect_timeout", "1s"), f"{path}.connect_timeout"),
        service_account=_service_account(d.get("service_account"), name, path),
        callers=parse_callers(d.get("callers"), f"{path}.callers"),
        locality=read_optional(d, "locality", path, parse_locality),
        model=model,
        aliases=aliases,
    )


def _service_account(raw: Any, service: str, path: str) -> str:
    if raw is None:
        return f"default/{service}"
    if not isinstance(raw, str) or not SERVICE_ACCOUNT.match(raw):
        raise MeshError(f"{path}.service_account: expected NAMESPACE/NAME, got {raw!r}")
    return raw


def _version(name: str, raw: Any, path: str) -> Version:
    check_name(name, path)
    d = read_mapping(raw, path)
    only_known(d, path, {"precision", "endpoints", "metrics_urls"})
    precision = d.get("precision")
    if precision is not None and precision not in ("bf16", "fp16", "int4"):
        raise MeshError(f"{path}.precision: expected bf16, fp16 or int4, got {precision!r}")
    eps = d.get("endpoints", [])
    if not isinstance(eps, list):
        raise MeshError(f"{path}.endpoints: expected a list of host:port")
    endpoints = tuple(parse_zoned_endpoint(e, f"{path}.endpoints[{i}]") for i, e in enumerate(eps))
    if len(set(endpoints)) != len(endpoints):
        raise MeshError(f"{path}.endpoints: duplicate endpoint")
    urls = d.get("metrics_urls", [])
    if not isinstance(urls, list):
        raise MeshError(f"{path}.metrics_urls: expected a list of http(s) URLs")
    metrics = tuple(read_url(u, f"{path}.metrics_urls[{i}]") for i, u in enumerate(urls))
    return Version(name=name, precision=precision, endpoints=endpoints, metrics_urls=metrics)


def _route(raw: Any, versions: dict[str, Version], path: str) -> Route:
    if raw is None:
        if len(versions) != 1:
            raise MeshError(f"{path}.weights: required when a service has several versions")
        return Route(weights={next(iter(versions)): 100})
    d = read_mapping(raw, path)
    only_known(
        d,
        path,
        {
            "weights",
            "hash_policy",
            "use_hash_policy",
            "canary_header",
            "max_stream_duration",
            "stream_idle_timeout",
        },
    )
    weights = check_weights(
        read_mapping(d.get("weights"), f"{path}.weights"), versions, path + ".weights"
    )
    hp = None
    if "hash_policy" in d:
        h = read_mapping(d["hash_policy"], f"{path}.hash_policy")
        only_known(h, f"{path}.hash_policy", {"header"})
        header = h.get("header")
        if not isinstance(header, str) or not header:
            raise MeshError(f"{path}.hash_policy.header: expected a header name")
        hp = HashPolicy(header=header.lower())
    use_hash = d.get("use_hash_policy", False)
    if not isinstance(use_hash, bool):
        raise MeshError(f"{path}.use_hash_policy: expected true or false, got {use_hash!r}")
    if use_hash and hp is None:
        raise MeshError(f"{path}.use_hash_policy: needs a hash_policy (the header to hash)")
    canary_header = d.get("canary_header", CANARY_HEADER)
    if not isinstance(canary_header, str) or not canary_header:
        raise MeshError(f"{path}.canary_header: expected a header name")
    return Route(
        weights=weights,
        hash_policy=hp,
        use_hash_policy=use_hash,
        canary_header=canary_header.lower(),
        max_stream_duration=parse_duration(
            d.get("max_stream_duration", 0), f"{path}.max_stream_duration"
        ),
        stream_idle_timeout=parse_duration(
            d.get("stream_idle_timeout", "300s"), f"{path}.stream_idle_timeout"
        ),
    )


def _load_balancing(raw: Any, route: Route, path: str) -> str:
    if raw is None:
        return "ring_hash" if route.hash_policy else "round_robin"
    if raw not in LOAD_BALANCING:
        raise MeshError(f"{path}: expected one of {', '.join(LOAD_BALANCING)}, got {raw!r}")
    if raw == "ring_hash" and route.hash_policy is None:
        raise MeshError(f"{path}: ring_hash needs route.hash_policy (the header to hash)")
    return raw


def _hash_balance_factor(raw: Any, lb: str, path: str) -> int | None:
    if raw is None:
        return HASH_BALANCE_FACTOR if lb == "prefix_aware" else None
    if lb not in ("ring_hash", "prefix_aware"):
        raise MeshError(
            f"{path}.hash_balance_factor: bounds a consistent hash's load; needs load_balancing "
            f"ring_hash or prefix_aware, not {lb}"
        )
    return read_int(raw, f"{path}.hash_balance_factor", 100)


def _rollout(name: str, raw: Any, services: dict[str, Service], path: str) -> Rollout:
    if name not in services:
        raise MeshError(f"{path}: unknown service (known: {', '.join(services)})")
    d = read_mapping(raw, path)
    known = {"stable", "canary", "steps", "interval", "threshold", "gates", "ack_timeout"}
    only_known(d, path, known | {"quality"})
    versions = services[name].versions
    for key in ("stable", "canary"):
        if not isinstance(d.get(key), str) or d[key] not in versions:
            raise MeshError(
                f"{path}.{key}: unknown version {d.get(key)!r} (known: {', '.join(versions)})"
            )
    if d["stable"] == d["canary"]:
        raise MeshError(f"{path}.canary: must differ from stable")
    steps = d.get("steps")
    if not isinstance(steps, list) or not steps:
        raise MeshError(f"{path}.steps: expected a list of percentages like [5, 25, 50, 100]")
    for i, s in enumerate(steps):
        read_int(s, f"{path}.steps[{i}]", 1, 100)
        if i and s <= steps[i - 1]:
            raise MeshError(f"{path}.steps[{i}]: steps must be ascending")
    gates = read_mapping(d.get("gates", {}), f"{path}.gates")
    try:
        spec = parse_rollout(name, d)  # the controller's own validator: gate names and values
    except RolloutSpecError as e:
        raise MeshError(str(e)) from None
    return Rollout(
        service=name,
        stable=d["stable"],
        canary=d["canary"],
        steps=tuple(steps),
        interval=parse_duration(d.get("interval", "30s"), f"{path}.interval"),
        threshold=read_int(d.get("threshold", 2), f"{path}.threshold", 1),
        gates=dict(gates),
        ack_timeout=parse_duration(d.get("ack_timeout", "10s"), f"{path}.ack_timeout"),
        # as validated: a prompts_file is read once, at load
        quality=None if spec.quality is None else spec.quality.to_dict(),
    )

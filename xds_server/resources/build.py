"""Envoy resources for one sidecar group, built from the mesh and the group's NodeInfo."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import yaml
from google.protobuf.message import Message

from mesh_common import headers
from mesh_common import type_urls as t
from xds_server import mesh as m
from xds_server.mesh import callers
from xds_server.resources import (
    access_log,
    clusters,
    endpoints,
    faults,
    listeners,
    names,
    ratelimit,
    rbac,
    routes,
    tls,
)
from xds_server.xds.node import NodeInfo


class ResourceError(ValueError):
    """The mesh and a node's metadata do not make a valid configuration."""


def build_resources(mesh: m.Mesh, node: NodeInfo) -> dict[str, dict[str, Message]]:
    out: dict[str, dict[str, Message]] = {tu: {} for tu in t.PUSH_ORDER}
    if node.outbound_port is not None:
        _outbound(mesh, node, out)
    if node.inbound_port is not None:
        _inbound(mesh, node, out)
    return out


def _outbound(mesh: m.Mesh, node: NodeInfo, out: dict[str, dict[str, Message]]) -> None:
    # Behind authz, an outbound health probe (no API key) would be denied by the inbound
    # sidecar and eject every host: then the inbound sidecar probes its runtime, and callers
    # rely on outlier detection.
    probe = mesh.authz.mode == "none"
    for svc in mesh.services.values():
        for v, ver in svc.versions.items():
            name = names.outbound_cluster(svc.name, v)
            out[t.CLUSTER][name] = clusters.cluster(
                name,
                svc,
                active_health=probe,
                caller_side=True,
                transport_socket=tls.caller_transport_socket(mesh, svc),
            )
            out[t.ENDPOINT][name] = _caller_assignment(name, ver, svc, node)
        mirror = svc.route.mirror
        if mirror is not None:  # the quality gate's shadow copies (routes._mirrored)
            name = names.shadow_cluster(svc.name, mirror.version)
            out[t.CLUSTER][name] = clusters.shadow_cluster(
                name, svc, transport_socket=tls.caller_transport_socket(mesh, svc)
            )
            shadowed = svc.versions[mirror.version]
            out[t.ENDPOINT][name] = _caller_assignment(name, shadowed, svc, node)
    rc = routes.outbound_route_config(mesh)
    out[t.ROUTE][rc.name] = rc
    idle = max((s.route.stream_idle_timeout for s in mesh.services.values()), default=300.0)
    out[t.LISTENER][names.OUTBOUND_LISTENER] = listeners.http_listener(
        names.OUTBOUND_LISTENER,
        host=node.listen_host,
        port=node.outbound_port,
        route_config_name=rc.name,
        stat_prefix="outbound",
        stream_idle_timeout=idle,
        access_log=access_log.access_logs(
            mesh.access_log, names.OUTBOUND_LISTENER, inbound=False, tenant=False
        )
        + ([access_log.outcome_log()] if any(s.isolation for s in mesh.services.values()) else []),
        # The fault filter after the class filter: a faulted call is still classified; authz
        # runs on the inbound sidecar, so no fault can let a call past it.
        authz_filters=[*_classify_filters(), faults.fault_filter()],
        # The class, the prefix key and the model are the filter's alone; stripped first, so a
        # failed VM can't pass a spoof.
        strip_request_headers=(headers.CLASS_HEADER, headers.PREFIX_HEADER, headers.MODEL_HEADER),
    )


def _classify_filters() -> list[listeners.HttpFilter]:
    """The class filter on every caller-side listener, inline (see classify_xds)."""
    try:
        cx = importlib.import_module("wasm_filters.classify_xds")
    except ModuleNotFoundError:
        raise ResourceError(
            "outbound listener: the class filter needs wasm_filters, which is not installed"
        ) from None
    return [cx.classify_http_filter()]


def _inbound(mesh: m.Mesh, node: NodeInfo, out: dict[str, dict[str, Message]]) -> None:
    svc = mesh.services.get(node.service or "")
    if svc is None:
        raise ResourceError(
            f"node metadata meshlm.service: unknown service {node.service!r} "
            f"(known: {', '.join(mesh.services)})"
        )
    ver = svc.versions.get(node.version or "")
    if ver is None:
        raise ResourceError(
            f"node metadata meshlm.version: unknown version {node.version!r} of {svc.name} "
            f"(known: {', '.join(svc.versions)})"
        )
    cname = names.inbound_cluster(svc.name, ver.name)
    # The local runtime; a single-replica mesh may list it as the version's endpoint.
    local = (
        (m.parse_endpoint(node.local_endpoint, "node metadata meshlm.local_endpoint"),)
        if node.local_endpoint
        else ver.endpoints
    )
    http = (
        (m.parse_endpoint(node.local_http_endpoint, "node metadata meshlm.local_http_endpoint"),)
        if node.local_http_endpoint
        else ()
    )
    exposed = tls.off_loopback((*local, *http)) if tls.mtls(mesh) else []
    if exposed:
        # With mTLS the runtime accepts connections only from its own sidecar: one reachable
        # from other hosts takes plaintext calls around the sidecar's mTLS and authz.
        raise ResourceError(
            f"node metadata meshlm.local_endpoint: the runtime of {svc.name}/{ver.name} at "
            f"{exposed[0]} is not on loopback; with identity (mTLS) a runtime listens on "
            "127.0.0.1 behind its own sidecar (meshlm serve --host 127.0.0.1, the default), or "
            "set identity.mtls: off"
        )
    out[t.CLUSTER][cname] = clusters.cluster(cname, svc)
    out[t.ENDPOINT][cname] = endpoints.load_assignment(cname, local)
    orca = names.inbound_orca_cluster(svc.name, ver.name)
    out[t.CLUSTER][orca] = clusters.orca_cluster(orca, svc)
    out[t.ENDPOINT][orca] = endpoints.load_assignment(orca, local)
    http_cluster = None
    if http:
        # The OpenAI HTTP API: no gRPC health probe there (the gRPC cluster's
        # probe covers the runtime); outlier detection as for gRPC.
        http_cluster = names.inbound_http_cluster(svc.name, ver.name)
        out[t.CLUSTER][http_cluster] = clusters.cluster(
            http_cluster, svc, active_health=False, http1=True
        )
        out[t.ENDPOINT][http_cluster] = endpoints.load_assignment(http_cluster, http)
    authz = _authz_filters(mesh, svc.name, out)
    mirror = svc.route.mirror
    rc = routes.inbound_route_config(
        svc,
        ver.name,
        tuple(f.name for f in authz),
        http_cluster=http_cluster,
        mirrored=mirror is not None and mirror.version == ver.name,
        orca_callers=rbac.orca_callers(svc, mesh.identity.trust_domain if mesh.identity else ""),
        # The endpoint this sidecar serves is where callers reach it: its listen address and
        # inbound port (a registered host registers that same address).
        fault=faults.host_fault(mesh.faults.values(), svc.name, ver.name, node.inbound_endpoint),
    )
    out[t.ROUTE][rc.name] = rc
    lname = names.inbound_listener(svc.name, ver.name)
    out[t.LISTENER][lname] = listeners.http_listener(
        lname,
        host=node.listen_host,
        port=node.inbound_port,
        route_config_name=rc.name,
        stat_prefix=f"inbound_{svc.name}_{ver.name}",
        stream_idle_timeout=svc.route.stream_idle_timeout,
        # A host's fault after authz: a call that authz refuses is refused at once.
        authz_filters=[*authz, faults.fault_filter()],
        access_log=access_log.access_logs(
            mesh.access_log, lname, inbound=True, tenant=bool(authz), peer=tls.mtls(mesh)
        ),
        # A denied request must not carry (or log) a client-sent tenant either.
        # Only the shadow route sets x-meshlm-shadow (routes._shadow_twin): a caller's goes.
        strip_request_headers=(
            *(headers.IDENTITY_HEADERS if authz or mesh.identity else ()),
            headers.SHADOW_HEADER,
        ),
        local_reply=listeners.died_holding_the_call_reply(),
        grpc_stats=False,  # the gates read the callers' counters; here it would cost every call
        transport_socket=tls.inbound_transport_socket(mesh),
        # A slow client is held here, never at the runtime: its whole request must arrive in
        # time, and an OpenAI request reaches the runtime only once its body is complete.
        body_filters=[listeners.buffer_filter(routes.OPENAI_MAX_BODY)] if http_cluster else [],
        request_deadlines=True,
    )


def _authz_filters(
    mesh: m.Mesh, service: str, out: dict[str, dict[str, Message]]
) -> list[listeners.HttpFilter]:
    svc = mesh.services[service]
    # Workload identity first: an unlisted caller reaches no key check.
    td = mesh.identity.trust_domain if mesh.identity else ""
    workloads = [f for f in (rbac.callers_filter(svc, td),) if f is not None]
    mode = mesh.authz.mode
    if mode == "none":
        return workloads
    xds = _wasm_xds(mode)
    # Limits are mesh-wide promises: by default each sidecar enforces its
    # share of them; `rate_limits.mode: global` asks the control plane on every call instead.
    policy = ratelimit.local_policy(mesh, svc)
    if mode == "native":
        keys = read_keys(mesh.authz.keys_file or "")
        filters = list(xds.native_http_filters(policy, service=service, keys=keys))
    else:
        ext = xds.wasm_extension_config(
            policy, service=service, name=names.AUTHZ_FILTER, **_wasm_callers(mesh, svc, xds)
        )
        out[t.EXTENSION_CONFIG][ext.name] = ext
        filters = [listeners.ecds_filter(names.AUTHZ_FILTER)]
    # A service with an SLO gets it too: the SLO loop sheds tenants there (xds_server/slo/loop.py).
    global_tier = svc.slo or any(tn.rate_limit for tn in mesh.tenants.tenants)
    if mesh.rate_limits.mode == "global" and global_tier:
        filters.append(ratelimit.ratelimit_filter(service))
    return [*workloads, *filters]


def _wasm_callers(mesh: m.Mesh, svc: m.Service, xds: ModuleType) -> dict:
    """The Wasm filter's side of workload identity: with mTLS it reads the caller's SPIFFE ID
    (and forwards it to the runtime); with `callers` it also decides on it."""
    if not tls.mtls(mesh) or mesh.identity is None:
        return {}
    td = mesh.identity.trust_domain
    rules = None
    if svc.callers is not None:
        rules = [xds.CallerRule(*r) for r in callers.rules(td, svc.callers)]
    return {"peer_identity": True, "callers": rules}


def _wasm_xds(mode: str) -> ModuleType:
    try:
        return importlib.import_module("wasm_filters.xds")
    except ModuleNotFoundError:
        raise ResourceError(
            f"authz.mode: {mode} needs wasm_filters.xds, which is not installed"
        ) from None


def read_keys(path: str) -> dict[str, list[str]]:
    """The native authz mode's keys file: tenant -> plaintext key or [keys]. ResourceError
    names the file, never a key."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or type(e).__name__
        raise ResourceError(f"authz.keys_file: cannot read {path}: {why}") from None
    except yaml.YAMLError as e:  # its message quotes the file: secrets stay out of errors
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise ResourceError(f"authz.keys_file: {path} is not YAML{where}") from None
    if not isinstance(raw, dict):
        raise ResourceError("authz.keys_file: expected a mapping tenant -> key or [keys]")
    return {str(t): [k] if isinstance(k, str) else list(k) for t, k in raw.items()}


def _caller_assignment(name: str, ver: m.Version, svc: m.Service, node: NodeInfo) -> Message:
    """A version's endpoints (static and registered) as the caller `node` sees them: its own
    zone first, in the service's failover order."""
    return endpoints.load_assignment(
        name, ver.endpoints, ver.registered, caller_zone=node.zone, locality=svc.locality
    )

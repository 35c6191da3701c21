"""RouteConfiguration: a virtual host per service, weighted clusters over its versions."""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2, substitution_format_string_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.buffer.v3 import buffer_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import struct_pb2, wrappers_pb2
from google.protobuf.message import Message

from mesh_common import headers
from schemas import codec
from xds_server import mesh as m
from xds_server.mesh.faults import Fault
from xds_server.resources import faults, listeners, names, rbac
from xds_server.resources.common import duration, pack, u32

QUARANTINED_MESSAGE = "request class quarantined: it broke runtimes (no isolation pool)"

# The one method a caller-side Envoy's least_loaded balancer calls on every host it balances
# over (out-of-band ORCA, xds/service/orca/v3/orca.proto): it reaches the runtime through its
# inbound sidecar without tenant authz, since Envoy sends no API key on it. Envoy opens it on
# the cluster's own connections, never through a listener: a client's call to the service is
# refused by its caller sidecar.
ORCA_SERVICE_PREFIX = "/xds.service.orca.v3.OpenRcaService/"
ORCA_PATH = ORCA_SERVICE_PREFIX + "StreamCoreMetrics"
ORCA_REFUSED_MESSAGE = "load reports (OpenRcaService) are for the mesh's sidecars, not for clients"
# The runtime's OpenAI-compatible HTTP API (model_runtime/serving/openai_http.py).
OPENAI_PREFIX = "/v1/"
# The most the inbound sidecar buffers of one OpenAI request: the runtime's own body limit.
OPENAI_MAX_BODY = codec.DEFAULT_LIMITS.max_buffer_bytes


def stable_and_canary(mesh: m.Mesh, svc: m.Service) -> tuple[str, str | None]:
    """The rollout controller's pins when set (a succeeded rollout swaps them), else the mesh
    file's rollout pair, else the first two versions in file order (never by weight: the pins
    must not swap when a canary passes 50 %)."""
    if svc.route.pins is not None:
        return svc.route.pins
    ro = mesh.rollouts.get(svc.name)
    if ro:
        return ro.stable, ro.canary
    names = list(svc.versions)
    return names[0], (names[1] if len(names) > 1 else None)


# A shadow's :authority is Envoy's mirror's own (`llm-shadow`, `llm-shadow:8080`).
SHADOW_AUTHORITY = r"^.+-shadow(:[0-9]+)?$"
FORGED_SHADOW_MESSAGE = (
    "a :authority ending in -shadow is reserved for the quality gate's mirrored copies; "
    "a caller cannot send one"
)


def outbound_route_config(mesh: m.Mesh) -> route_pb2.RouteConfiguration:
    return route_pb2.RouteConfiguration(
        name=names.OUTBOUND_ROUTE,
        virtual_hosts=[
            *(_faulted(mesh, _vhost(s, _service_routes(mesh, s))) for s in mesh.services.values()),
            _unmatched_vhost(mesh),
        ],
    )


def _faulted(mesh: m.Mesh, vhost: rc.VirtualHost) -> rc.VirtualHost:
    """The service's mesh fault, if any, on its virtual host (only its own callers' calls); a
    fault on one host is that host's inbound sidecar's (inbound_route_config)."""
    faults.apply(vhost, faults.caller_fault(mesh.faults.values(), vhost.name))
    return vhost


def _unmatched_vhost(mesh: m.Mesh) -> rc.VirtualHost:
    """Any :authority that names no service. A caller's call to `<service>-shadow` is refused
    (403: gRPC PERMISSION_DENIED) before it could reach a runtime as a shadow (uncharged by the
    rate limits, out of the gates' figures). A call whose body names a model goes by the model
    (model_routes), where the mesh declares any. An OpenAI call (/v1/) goes to the mesh's
    default service (the openai SDK names the model in the body, never a Host), by that
    service's own routes. Anything else gets a 404 that names the services and how to pick
    one."""
    routes = [_refuse_shadow("forged-shadow"), *model_routes(mesh)]
    default = mesh.openai_default
    if default is not None:
        svc = mesh.services[default]
        for route in _service_routes(mesh, svc, OPENAI_PREFIX):
            route.name = f"{DEFAULT_ROUTE_PREFIX}{route.name}"
            if route.HasField("route"):  # the runtime's sidecar sees the service's name
                route.route.host_rewrite_literal = svc.name
            routes.append(route)
    routes.append(
        rc.Route(
            name="no-service",
            match=rc.RouteMatch(prefix="/"),
            direct_response=rc.DirectResponseAction(
                status=404, body=base_pb2.DataSource(inline_string=no_service_message(mesh))
            ),
        )
    )
    return rc.VirtualHost(name="unmatched", domains=["*"], routes=routes)


# The default service's routes in the unmatched virtual host: its own route names, prefixed.
DEFAULT_ROUTE_PREFIX = "default-service-"
# A modelled service's routes there, by the request's model (x-meshlm-model): its names, prefixed.
MODEL_ROUTE_PREFIX = "model-"
UNKNOWN_MODEL_ROUTE = "unknown-model"
MODELS_PATH = "/v1/models"
GRPC_NOT_FOUND = "5"


def model_routes(mesh: m.Mesh) -> list[rc.Route]:
    """The unmatched virtual host's routes by model, before the default service's: a call
    whose Host names no service reaches the service whose `model` or `aliases` its body names
    (the classify filter's x-meshlm-model, compared ignoring case), by that service's own
    routes (quarantines, pins, split, retries). A model no service declares gets a 404
    (OpenAI `model_not_found`; gRPC NOT_FOUND) and reaches no runtime, except an OpenAI call
    where the mesh's default service declares no model: its runtime's own names are not the
    mesh's to know, so such calls go there as before. `GET /v1/models` (and
    `/v1/models/{id}`) lists the mesh's models at the caller sidecar, in place of the default
    service's own list. None of this exists in a mesh without models."""
    modelled = [s for s in mesh.services.values() if s.model]
    if not modelled:
        return []
    routes = [*_models_list(mesh)]
    for svc in modelled:
        fault = faults.caller_fault(mesh.faults.values(), svc.name)
        # One copy of the service's routes per name: a header matches one StringMatcher, and
        # one RE2 alternation of every name outgrows Envoy's regex program size limit (100)
        # at a few long names (the route config is NACKed).
        for model in svc.model_names:
            for route in _service_routes(mesh, svc, "/"):
                route.name = f"{MODEL_ROUTE_PREFIX}{model}-{route.name}"
                route.match.headers.append(_names_model(model))
                if route.HasField("route"):  # the runtime's sidecar sees the service's name
                    route.route.host_rewrite_literal = svc.name
                if svc.stall is not None:  # what its own virtual host tells the caller library
                    route.response_headers_to_add.append(
                        _header(headers.STALL_HEADER, svc.stall.header_value())
                    )
                if fault is not None:  # its callers' fault, as on its own virtual host
                    route.typed_per_filter_config[faults.FILTER_NAME].CopyFrom(
                        pack(faults.http_fault(fault))
                    )
                routes.append(route)
    routes.append(_unknown_model(mesh, grpc=True))
    default = mesh.openai_default
    if default is None or mesh.services[default].model:
        routes.append(_unknown_model(mesh, grpc=False))
    return routes


def mesh_model_names(mesh: m.Mesh) -> list[str]:
    return [n for s in mesh.services.values() for n in s.model_names]


def _names_model(name: str) -> rc.HeaderMatcher:
    from envoy.type.matcher.v3 import string_pb2

    match = string_pb2.StringMatcher(exact=name, ignore_case=True)
    return rc.HeaderMatcher(name=headers.MODEL_HEADER, string_match=match)


def _model_present() -> rc.HeaderMatcher:
    return rc.HeaderMatcher(name=headers.MODEL_HEADER, present_match=True)


def _unknown_model(mesh: m.Mesh, *, grpc: bool) -> rc.Route:
    """404 for a model no service declares, naming it (Envoy formats the request's header into
    the body). gRPC: Envoy turns a local reply's 404 into UNIMPLEMENTED unless the reply
    already carries a grpc-status, which this route adds (NOT_FOUND), the body becoming its
    grpc-message. OpenAI: the error JSON the SDKs read `code` from; its content type is JSON
    before the listener's OpenAI local-reply mappers look, so they leave it alone
    (listeners.OPENAI_LOCAL_REPLY). Both checked on Envoy 1.40."""
    models = ", ".join(mesh_model_names(mesh))
    said = f"The model `%REQ({headers.MODEL_HEADER})%` does not exist in this mesh"
    match = rc.RouteMatch(prefix="/", headers=[_model_present()])
    if grpc:
        match.grpc.SetInParent()
        body = substitution_format_string_pb2.SubstitutionFormatString(
            text_format_source=base_pb2.DataSource(inline_string=f"{said} (models: {models})")
        )
        added = [_header("grpc-status", GRPC_NOT_FOUND)]
    else:
        added = []
        error = struct_pb2.Struct()
        error.update({
            "message": f"{said}; models: {models} (GET {MODELS_PATH} lists them)",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        })  # fmt: skip
        doc = struct_pb2.Struct()
        doc.fields["error"].struct_value.CopyFrom(error)
        body = substitution_format_string_pb2.SubstitutionFormatString(
            json_format=doc, content_type="application/json"
        )
    return rc.Route(
        name=f"{UNKNOWN_MODEL_ROUTE}{'-grpc' if grpc else ''}",
        match=match,
        direct_response=rc.DirectResponseAction(status=404, body_format=body),
        response_headers_to_add=added,
    )


def _models_list(mesh: m.Mesh) -> list[rc.Route]:
    """`GET /v1/models`: every model and alias of the mesh, OpenAI-shaped (owned_by: the
    service); `GET /v1/models/{id}`: one of them (any case), else 404 model_not_found."""
    entries = {
        n: {"id": n, "object": "model", "created": 0, "owned_by": s.name}
        for s in mesh.services.values()
        for n in s.model_names
    }
    get = rc.HeaderMatcher(name=":method", string_match=_exact("GET"))

    def reply(name: str, match: rc.RouteMatch, status: int, doc: object) -> rc.Route:
        return rc.Route(
            name=name,
            match=match,
            direct_response=rc.DirectResponseAction(
                status=status, body=base_pb2.DataSource(inline_string=json.dumps(doc))
            ),
            # JSON already: the listener's OpenAI local-reply mappers leave it as it is.
            response_headers_to_add=[_header("content-type", "application/json")],
        )

    listed = {"object": "list", "data": list(entries.values())}
    routes = [reply("models-list", rc.RouteMatch(path=MODELS_PATH, headers=[get]), 200, listed)]
    for n, entry in entries.items():
        one = rc.RouteMatch(path=f"{MODELS_PATH}/{n}", headers=[get])
        one.case_sensitive.value = False
        routes.append(reply(f"models-{n}", one, 200, entry))
    missing = {
        "error": {
            "message": f"The model does not exist in this mesh; models: {', '.join(entries)}",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    routes.append(
        reply(
            "models-unknown", rc.RouteMatch(prefix=f"{MODELS_PATH}/", headers=[get]), 404, missing
        )
    )
    return routes


def no_service_message(mesh: m.Mesh) -> str:
    """The caller sidecar's 404 for an authority that names no service of the mesh."""
    names_ = list(mesh.services)
    default = mesh.openai_default
    taken = f"; default_service {default} takes OpenAI /v1/ calls only" if default else ""
    models = mesh_model_names(mesh)
    by_model = f", or name one of its models in the request's model ({', '.join(models)})"
    return (
        f"the Host header (gRPC: :authority) names no service of this mesh (services: "
        f"{', '.join(names_)}{taken}): name one there (the openai SDK: "
        f'default_headers={{"Host": "{names_[0]}"}}), or name the service OpenAI /v1/ calls '
        f"go to as default_service in the mesh file{by_model if models else ''}"
    )


def _shadow_authority() -> rc.HeaderMatcher:
    from envoy.type.matcher.v3 import regex_pb2, string_pb2

    regex = regex_pb2.RegexMatcher(regex=SHADOW_AUTHORITY)
    match = string_pb2.StringMatcher(safe_regex=regex)
    return rc.HeaderMatcher(name=":authority", string_match=match)


def _service_routes(mesh: m.Mesh, svc: m.Service, prefix: str = "/") -> list[rc.Route]:
    """A service's routes for paths under `prefix`: "/" (all: its own virtual host) or
    OPENAI_PREFIX (its OpenAI calls only, as the default service)."""
    # Quarantined classes first: neither a canary pin nor the split may reach the main pool.
    routes = [_quarantine_route(svc, q, prefix) for q in svc.quarantined]
    if prefix == "/":
        routes.insert(0, _refuse_orca(svc))
    stable, canary = stable_and_canary(mesh, svc)
    if svc.stall is not None:
        routes += _version_pins(svc, {stable, canary} - {None}, prefix)
    openai_apart = svc.stall is not None or (svc.retry_policy and svc.retry_policy.per_try_timeout)
    if prefix == "/" and openai_apart:
        # The OpenAI HTTP API: a completion without `stream` sends its headers with
        # the whole answer, so a per-try (idle) timeout would cut every long one and run it
        # again; its calls get the same split and retries without per-try limits. No retry
        # follows response headers, so a streamed answer is never sent twice.
        routes += _split_routes(svc, stable, canary, OPENAI_PREFIX)
    return [*routes, *_split_routes(svc, stable, canary, prefix)]


def _refuse_orca(svc: m.Service) -> rc.Route:
    """403 (gRPC PERMISSION_DENIED) for a client's call to OpenRcaService: key-less, it would
    pass the inbound sidecar's ORCA route and hold a report stream on a runtime."""
    return rc.Route(
        name=f"{svc.name}-orca-refused",
        match=rc.RouteMatch(prefix=ORCA_SERVICE_PREFIX),
        direct_response=rc.DirectResponseAction(
            status=403, body=base_pb2.DataSource(inline_string=ORCA_REFUSED_MESSAGE)
        ),
    )


def _split_routes(svc: m.Service, stable: str, canary: str | None, prefix: str) -> list[rc.Route]:
    """The `x-canary: always|never` pins, then the weighted split, for paths under `prefix`."""
    per_try = prefix == "/"
    suffix = "" if per_try else "-openai"
    routes = []
    if canary is not None:
        # Header pins before the weighted split: `x-canary: always|never`.
        for value, version in (("always", canary), ("never", stable)):
            pin = rc.Route(
                name=f"{svc.name}-canary-{value}{suffix}",
                match=rc.RouteMatch(
                    prefix=prefix,
                    headers=[
                        rc.HeaderMatcher(
                            name=svc.route.canary_header,
                            string_match=_exact(value),
                        )
                    ],
                ),
                route=_action(
                    svc, cluster=names.outbound_cluster(svc.name, version), per_try=per_try
                ),
                response_headers_to_add=_served_by(svc, version),
            )
            if svc.route.mirror is None or svc.route.mirror.version != version:
                routes += _mirrored(svc, pin)
            routes.append(pin)
    weighted = rc.WeightedCluster(
        clusters=[
            rc.WeightedCluster.ClusterWeight(
                name=names.outbound_cluster(svc.name, v),
                weight=u32(w),
                response_headers_to_add=_served_by(svc, v),
            )
            for v, w in svc.route.weights.items()
        ],
        # Sticky sessions: the hash of the route's hash_policy header, not a fresh random
        # number, picks the version; a request without the header still gets a random pick.
        use_hash_policy=wrappers_pb2.BoolValue(value=svc.route.use_hash_policy),
    )
    split = rc.Route(
        name=f"{svc.name}-weighted{suffix}",
        match=rc.RouteMatch(prefix=prefix),
        route=_action(svc, weighted=weighted, per_try=per_try),
    )
    return [*routes, *_mirrored(svc, split), split]


def _mirrored(svc: m.Service, route: rc.Route) -> list[rc.Route]:
    """While a rollout's quality gate mirrors: `route`'s twin for the calls marked
    `x-meshlm-mirror: safe`, whose action also copies `percent` of them to the canary's shadow
    cluster (Envoy appends -shadow to the copy's :authority and drops its answer; the caller
    gets the primary's only). An unmarked call matches `route` itself: never mirrored. A call
    the split sends to the canary is copied too; the stable holds no record of it, so the
    join finds no pair and it is not a sample."""
    mirror = svc.route.mirror
    if mirror is None or mirror.percent <= 0:
        return []
    twin = rc.Route()
    twin.CopyFrom(route)
    twin.name = f"{route.name}-mirror"
    twin.match.headers.append(
        rc.HeaderMatcher(name=headers.MIRROR_HEADER, string_match=_exact(headers.MIRROR_SAFE))
    )
    twin.route.request_mirror_policies.append(
        rc.RouteAction.RequestMirrorPolicy(
            cluster=names.shadow_cluster(svc.name, mirror.version),
            runtime_fraction=base_pb2.RuntimeFractionalPercent(
                default_value=percent_pb2.FractionalPercent(
                    numerator=round(mirror.percent * 10_000),
                    denominator=percent_pb2.FractionalPercent.MILLION,
                ),
                runtime_key=f"meshlm.mirror.{svc.name}",
            ),
        )
    )
    return [twin]


def _vhost(svc: m.Service, routes: list[rc.Route]) -> rc.VirtualHost:
    # gRPC clients put the service name (maybe with a port) in :authority.
    vhost = rc.VirtualHost(name=svc.name, domains=[svc.name, f"{svc.name}:*"], routes=routes)
    if svc.stall is not None:
        vhost.response_headers_to_add.append(
            _header(headers.STALL_HEADER, svc.stall.header_value())
        )
    return vhost


def _version_pins(svc: m.Service, pinned: set[str], prefix: str = "/") -> list[rc.Route]:
    """`x-meshlm-version: V` pins a resumed stream to the version that served it. Only the
    versions a caller reaches anyway (weight above 0, or the x-canary pins) get a pin route; any
    other value falls through to the usual routes."""
    reachable = [v for v, w in svc.route.weights.items() if w > 0 or v in pinned]
    return [
        rc.Route(
            name=f"{svc.name}-resume-{v}",
            match=rc.RouteMatch(
                prefix=prefix,
                headers=[rc.HeaderMatcher(name=headers.VERSION_HEADER, string_match=_exact(v))],
            ),
            route=_action(svc, cluster=names.outbound_cluster(svc.name, v)),
            response_headers_to_add=_served_by(svc, v),
        )
        for v in reachable
    ]


def _served_by(svc: m.Service, version: str) -> list:
    return [] if svc.stall is None else [_header(headers.VERSION_HEADER, version)]


def _header(name: str, value: str):  # -> HeaderValueOption
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, value=value),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def quarantine_route_name(service: str, key: str) -> str:
    return f"{service}-isolation-{key}"


def _quarantine_route(svc: m.Service, q: m.Quarantine, prefix: str = "/") -> rc.Route:
    match = rc.RouteMatch(
        prefix=prefix,
        headers=[rc.HeaderMatcher(name=headers.CLASS_HEADER, string_match=_exact(q.key))],
    )
    if q.probe_percent:
        # Half-open: the route takes all but probe_percent of the class; the rest falls through
        # to the main pool's routes.
        match.runtime_fraction.CopyFrom(
            base_pb2.RuntimeFractionalPercent(
                default_value=percent_pb2.FractionalPercent(numerator=100 - q.probe_percent),
                runtime_key=f"meshlm.isolation.{svc.name}.{q.key}",
            )
        )
    route = rc.Route(name=quarantine_route_name(svc.name, q.key), match=match)
    pool = svc.isolation.pool if svc.isolation else None
    if pool is not None:
        route.route.CopyFrom(_action(svc, cluster=names.outbound_cluster(svc.name, pool)))
    else:
        # A local reply to a gRPC call: Envoy sends grpc-status 14 (UNAVAILABLE) for a 503,
        # with the body as grpc-message.
        route.direct_response.CopyFrom(
            rc.DirectResponseAction(
                status=503, body=base_pb2.DataSource(inline_string=QUARANTINED_MESSAGE)
            )
        )
    return route


def inbound_route_config(
    svc: m.Service,
    version: str,
    authz_filters: tuple[str, ...] = (),
    *,
    http_cluster: str | None = None,
    mirrored: bool = False,
    orca_callers: Message | None = None,
    fault: Fault | None = None,
) -> route_pb2.RouteConfiguration:
    """`authz_filters`: the listener's tenant filters (authz, rate limits), turned off on the
    ORCA route only. That route carries read-only load figures (utilization, rps, queue and KV
    use) of this runtime, no tenant data; every other path still passes every filter.
    `orca_callers`: where the service lists `callers`, the RBAC filter's config on the ORCA
    route (rbac.orca_callers): the listed workloads' sidecars, on that one method.
    `http_cluster`: the runtime's OpenAI HTTP API, which takes every /v1/ path (the
    gRPC paths are /<package>.<Service>/<Method>, never /v1/). `fault`: a mesh fault on this
    host (resources/faults.host_fault), on every call but the ORCA load reports."""
    cluster = names.inbound_cluster(svc.name, version)
    orca = rc.Route(
        name=f"{svc.name}-{version}-orca",
        match=rc.RouteMatch(path=ORCA_PATH),
        route=_action(svc, cluster=names.inbound_orca_cluster(svc.name, version), retries=False),
    )
    off = pack(rc.FilterConfig(disabled=True))
    for f in (*authz_filters, faults.FILTER_NAME):
        orca.typed_per_filter_config[f].CopyFrom(off)
    if orca_callers is not None:
        orca.typed_per_filter_config[rbac.FILTER_NAME].CopyFrom(pack(orca_callers))
    route = rc.Route(
        name=f"{svc.name}-{version}-local",
        match=rc.RouteMatch(prefix="/"),
        route=_action(svc, cluster=cluster, retries=False),
    )
    openai = []
    if http_cluster is not None:
        r = rc.Route(
            name=f"{svc.name}-{version}-openai",
            match=rc.RouteMatch(prefix=OPENAI_PREFIX),
            route=_action(svc, cluster=http_cluster, retries=False),
        )
        # The whole request before the runtime sees it (listeners.buffer_filter).
        whole = buffer_pb2.Buffer(max_request_bytes=u32(OPENAI_MAX_BODY))
        r.typed_per_filter_config[listeners.BUFFER_FILTER].CopyFrom(
            pack(buffer_pb2.BufferPerRoute(buffer=whole))
        )
        openai.append(r)
    if mirrored:  # a rollout's quality gate copies calls to this version now
        routes = [r for x in (*openai, route) for r in (_shadow_twin(x), x)]
    else:  # no copy is due here: whoever sends one forges it
        routes = [_refuse_shadow(f"{svc.name}-{version}-forged-shadow"), *openai, route]
    vhost = rc.VirtualHost(name=f"{svc.name}-local", domains=["*"], routes=[orca, *routes])
    faults.apply(vhost, fault)
    return route_pb2.RouteConfiguration(
        name=names.inbound_route(svc.name, version), virtual_hosts=[vhost]
    )


def _refuse_shadow(name: str) -> rc.Route:
    """403 (gRPC PERMISSION_DENIED) for a -shadow :authority: outside a mirror to this version
    only a forger sends one, e.g. straight to this sidecar, around the caller's."""
    return rc.Route(
        name=name,
        match=rc.RouteMatch(prefix="/", headers=[_shadow_authority()]),
        direct_response=rc.DirectResponseAction(
            status=403, body=base_pb2.DataSource(inline_string=FORGED_SHADOW_MESSAGE)
        ),
    )


def _shadow_twin(route: rc.Route) -> rc.Route:
    """`route` for a mirrored copy (its :authority ends in -shadow): the runtime is
    told with `x-meshlm-shadow: 1`, which keeps it out of the gates' metrics. The listener
    strips a caller's own `x-meshlm-shadow` before any route (http_listener's early header
    mutation), so only this route can set it."""
    twin = rc.Route()
    twin.CopyFrom(route)
    twin.name = f"{route.name}-shadow"
    twin.match.headers.append(_shadow_authority())
    twin.request_headers_to_add.append(_header(headers.SHADOW_HEADER, "1"))
    return twin


def _action(
    svc: m.Service,
    *,
    cluster: str | None = None,
    weighted: rc.WeightedCluster | None = None,
    retries: bool = True,
    per_try: bool = True,
) -> rc.RouteAction:
    """`per_try`: the retry policy's per-try timeouts (and the stall's idle one) apply."""
    a = rc.RouteAction(
        # 0 disables the 15 s default route timeout, which would cut token streams.
        timeout=duration(0),
        max_stream_duration=rc.RouteAction.MaxStreamDuration(
            max_stream_duration=duration(svc.route.max_stream_duration),
            # Honour the client's grpc-timeout header, bounded by the stream limit.
            grpc_timeout_header_max=duration(svc.route.max_stream_duration),
        ),
    )
    if cluster is not None:
        a.cluster = cluster
    else:
        a.weighted_clusters.CopyFrom(weighted)
    if svc.route.hash_policy:
        a.hash_policy.append(
            rc.RouteAction.HashPolicy(
                header=rc.RouteAction.HashPolicy.Header(header_name=svc.route.hash_policy.header),
                # A call with a session keeps to its session's host; without one the
                # prompt-prefix key (next) decides.
                terminal=svc.load_balancing == "prefix_aware",
            )
        )
    if svc.load_balancing == "prefix_aware":
        # No key (a short or unreadable prompt): no hash, and the balancer picks a host at random.
        a.hash_policy.append(
            rc.RouteAction.HashPolicy(
                header=rc.RouteAction.HashPolicy.Header(header_name=headers.PREFIX_HEADER)
            )
        )
    policy = svc.retry_policy or (m.RetryPolicy() if svc.stall else None)
    if retries and policy:
        rp = rc.RetryPolicy(retry_on=policy.retry_on, num_retries=u32(policy.num_retries))
        if policy.per_try_timeout is not None and per_try:
            rp.per_try_timeout.CopyFrom(duration(policy.per_try_timeout))
            if policy.hedge_on_per_try_timeout:
                # The slow try keeps running and still counts as a timeout for outlier
                # detection (Envoy's router records it when it hedges).
                a.hedge_policy.hedge_on_per_try_timeout = True
        # A retry goes to another host: the one that failed is likely still down (concurrent
        # calls share the load balancer's turn, so without this a retry often gets it again).
        rp.retry_host_predicate.append(
            rc.RetryPolicy.RetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=pack(previous_hosts_pb2.PreviousHostsPredicate()),
            )
        )
        rp.host_selection_retry_max_attempts = 5
        if svc.locality is not None:
            # With zones as priorities a caller's own zone may hold only the host that failed,
            # which previous_hosts cannot leave: the retry goes to the next zone instead.
            rp.retry_priority.CopyFrom(
                rc.RetryPolicy.RetryPriority(
                    name="envoy.retry_priorities.previous_priorities",
                    typed_config=pack(
                        previous_priorities_config_pb2.PreviousPrioritiesConfig(update_frequency=1)
                    ),
                )
            )
        if svc.stall is not None and per_try:
            _stall_retries(rp, svc.stall)
        a.retry_policy.CopyFrom(rp)
    return a


def _stall_retries(rp: rc.RetryPolicy, stall: m.Stall) -> None:
    """An upstream silent for the stall's hard limit is reset (Envoy's per-try idle timeout, so
    it counts in the cluster's stats and outlier detection); before response headers the try is
    retried on another host (`reset`; every retry policy has `previous_hosts`), after them the
    caller library resumes.
    A resume refused by the replica it avoids (UNAVAILABLE) moves on the same way."""
    rp.per_try_idle_timeout.CopyFrom(duration(stall.hard_limit))
    on = rp.retry_on.split(",")
    rp.retry_on = ",".join(on + [c for c in ("reset", "unavailable") if c not in on])


def _exact(value: str):  # -> StringMatcher
    from envoy.type.matcher.v3 import string_pb2

    return string_pb2.StringMatcher(exact=value)

"""The mesh file (YAML) -> validated, frozen desired state.

Every error is a `MeshError` whose message starts with the field path, e.g.
`services.llm.route.weights.v3: unknown version (known: v1, v2)`. Names follow Envoy's API
(`outlier_detection`, `circuit_breakers`, `retry_budget`, `hash_policy`) so users recognise them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import ipaddress
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from xds_server.rollout_spec import RolloutSpecError, parse_rollout
from xds_server.source_url import url_problem


class MeshError(ValueError):
    """A mesh file that cannot be used; the message names the field."""


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
# x-meshlm-class: a hash of the request, never its text (issue 11).
CLASS_KEY = re.compile(r"^[0-9a-f]{16}$")
_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
# Envoy's retry_on tokens (HTTP router + gRPC, see router filter docs, x-envoy-retry-grpc-on).
RETRY_ON = frozenset(
    [
        "5xx",
        "gateway-error",
        "reset",
        "reset-before-request",
        "connect-failure",
        "envoy-ratelimited",
        "retriable-4xx",
        "refused-stream",
        "retriable-status-codes",
        "retriable-headers",
        "http3-post-connect-failure",
        "cancelled",
        "deadline-exceeded",
        "internal",
        "resource-exhausted",
        "unavailable",
    ]
)
AUTHZ_MODES = ("wasm", "native", "none")
# The gRPC methods every mesh service serves (schemas/inference.fbs): an allow rule's method
# part must match one of them, so a typo is an error at load, not a denial at run time.
METHODS = ("Generate", "Info")
# A service's host pick inside a version: least_loaded weighs hosts by the runtimes' ORCA load
# reports (Envoy's client_side_weighted_round_robin), ring_hash follows route.hash_policy.
LOAD_BALANCING = ("least_loaded", "round_robin", "ring_hash")


def parse_duration(value: Any, path: str) -> float:
    """`100ms`, `5s`, `1.5m`, `0s` -> seconds."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise MeshError(f"{path}: expected a duration like 100ms or 5s, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise MeshError(f"{path}: duration must not be negative")
        return float(value)
    m = _DURATION.match(value.strip())
    if not m:
        raise MeshError(f"{path}: expected a duration like 100ms or 5s, got {value!r}")
    return float(m.group(1)) * _UNIT[m.group(2)]


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Version:
    name: str
    precision: str | None
    endpoints: tuple[Endpoint, ...]
    # The runtimes' `GET /metrics` (TTFT/TPOT), read by rollout gates when this version is the
    # canary. Only the operator names them: a sidecar's own announcements are never read.
    metrics_urls: tuple[str, ...] = ()


@dataclass(frozen=True)
class HashPolicy:
    header: str


@dataclass(frozen=True)
class Route:
    weights: dict[str, int]
    hash_policy: HashPolicy | None = None
    # Envoy's WeightedCluster.use_hash_policy: the weighted version pick follows the hash
    # policy, so one session/tenant sticks to one version per canary step.
    use_hash_policy: bool = False
    canary_header: str = "x-canary"
    # Token streams: no route timeout; bound the whole stream and its idle gaps instead.
    max_stream_duration: float = 0.0  # 0 = unbounded
    stream_idle_timeout: float = 300.0
    # (stable, canary) for the `x-canary` pins, set by the rollout controller (a succeeded
    # rollout swaps them). None: the mesh file's rollout pair, else file order.
    pins: tuple[str, str] | None = None


@dataclass(frozen=True)
class OutlierDetection:
    consecutive_5xx: int | None = None
    consecutive_gateway_failure: int | None = None
    interval: float = 10.0
    base_ejection_time: float = 30.0
    max_ejection_percent: int = 10
    # Ejects a host whose share of failed calls in an interval reaches this percent. Unlike the
    # consecutive counters it sees a replica that stalls gRPC streams after their headers (issue
    # 10): each such stream records a 200 (headers) and then a timeout, which resets a counter.
    failure_percentage_threshold: int | None = None
    failure_percentage_minimum_hosts: int = 2
    failure_percentage_request_volume: int = 10


@dataclass(frozen=True)
class RetryBudget:
    budget_percent: float = 20.0
    min_retry_concurrency: int = 3


@dataclass(frozen=True)
class CircuitBreakers:
    max_connections: int | None = None
    max_pending_requests: int | None = None
    max_requests: int | None = None
    max_retries: int | None = None
    retry_budget: RetryBudget | None = None


@dataclass(frozen=True)
class RetryPolicy:
    retry_on: str = "unavailable,connect-failure"
    num_retries: int = 1
    per_try_timeout: float | None = None


# Caller-side route headers for stall resume (issue 10): the response says which version
# served and the service's stall policy; a resume's request pins that version.
VERSION_HEADER = "x-meshlm-version"
STALL_HEADER = "x-meshlm-stall"


@dataclass(frozen=True)
class Stall:
    """Token-stall detection in the caller library (issue 10): a stream with `consecutive`
    inter-token gaps over `gap` in a row, or one gap over `hard_limit`, is resumed on another
    replica of the same version, at most `max_resumes` times. Callers learn it from the
    `x-meshlm-stall` response header that the caller-side route adds."""

    gap: float = 1.0
    consecutive: int = 3
    hard_limit: float = 10.0
    max_resumes: int = 2

    def header_value(self) -> str:
        return (
            f"gap_ms={round(self.gap * 1000)};consecutive={self.consecutive};"
            f"hard_limit_ms={round(self.hard_limit * 1000)};max_resumes={self.max_resumes}"
        )

    @classmethod
    def from_header(cls, value: str) -> Stall:
        """The inverse of header_value; ValueError names a bad or missing part."""
        parts = dict(p.partition("=")[::2] for p in value.replace(" ", "").split(";") if p)
        want = ("gap_ms", "consecutive", "hard_limit_ms", "max_resumes")
        if sorted(parts) != sorted(want) or not all(parts[k].isdigit() for k in want):
            raise ValueError(f"{STALL_HEADER}: expected {'=N;'.join(want)}=N, got {value!r}")
        stall = cls(
            gap=int(parts["gap_ms"]) / 1000,
            consecutive=int(parts["consecutive"]),
            hard_limit=int(parts["hard_limit_ms"]) / 1000,
            max_resumes=int(parts["max_resumes"]),
        )
        return _stall_checked(stall, STALL_HEADER, ValueError)


SLO_ACTIONS = ("shed", "tighten_outlier", "scale_out")


@dataclass(frozen=True)
class Slo:
    """A service's objectives, evaluated every `interval` by the SLO loop (xds_server/slo.py):
    after `intervals` breached intervals in a row (the worst metric `deviation` past its target)
    it takes the next of `actions`; after `recover_intervals` met intervals it undoes the last."""

    ttft_p99: float | None = None  # seconds
    tpot_p99: float | None = None
    success_rate: float | None = None  # percent of calls not failed by a server fault
    interval: float = 10.0
    deviation: float = 0.15  # a fraction past the target: 0.15 = TTFT p99 15 % over
    intervals: int = 3
    recover_intervals: int = 6
    actions: tuple[str, ...] = SLO_ACTIONS
    max_replicas: int = 1  # scale_out adds at most this many replicas
    min_requests: int = 10  # fewer calls in an interval: no verdict either way


@dataclass(frozen=True)
class SloState:
    """What the SLO loop has done to a service (never read from the mesh file): tenants whose
    rate limits are tightened at the sidecars, and whether outlier detection is tightened."""

    shed_tenants: tuple[str, ...] = ()
    outlier_tightened: bool = False


@dataclass(frozen=True)
class HealthCheck:
    """Active gRPC health checking (grpc.health.v1)."""

    interval: float = 5.0
    # Envoy's default is 60 s while a cluster has no traffic; a canary at weight 0 must be
    # known healthy before traffic moves to it, so this defaults to `interval`.
    no_traffic_interval: float | None = None
    timeout: float = 1.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1
    service_name: str = ""


@dataclass(frozen=True)
class Isolation:
    """Semantic circuit breaking (issue 11): a request class (`x-meshlm-class`) whose error rate
    over `window` reaches `error_rate` (with at least `min_requests`) is routed to the `pool`
    version, or answered UNAVAILABLE when there is none. After `cooldown` (doubled on each
    relapse) `probe_percent` % of the class tries the main pool again (half-open)."""

    error_rate: float  # a fraction: "0.8%" -> 0.008
    window: float = 600.0
    min_requests: int = 20
    pool: str | None = None
    cooldown: float = 30.0
    max_classes: int = 10_000  # outcome windows kept per service (least recently seen go)
    probe_percent: int = 10


@dataclass(frozen=True)
class Quarantine:
    """One class routed away from the main pool, set by the isolation controller."""

    key: str  # 16 hex digits: the x-meshlm-class header
    probe_percent: int = 0  # half-open: this share of the class still reaches the main pool


@dataclass(frozen=True)
class Service:
    name: str
    versions: dict[str, Version]
    route: Route
    outlier_detection: OutlierDetection | None = None
    circuit_breakers: CircuitBreakers | None = None
    retry_policy: RetryPolicy | None = None
    health_check: HealthCheck | None = None
    stall: Stall | None = None
    connect_timeout: float = 1.0
    # Default: ring_hash when route.hash_policy is set (sticky hosts), else round_robin.
    load_balancing: str = "round_robin"
    slo: Slo | None = None
    slo_state: SloState = field(default_factory=SloState)
    isolation: Isolation | None = None
    quarantined: tuple[Quarantine, ...] = ()
    # Its workloads' identity, `NAMESPACE/NAME` (issue 14); default `default/<service>`.
    service_account: str = ""
    # Its live inbound sidecars, counted from ADS by the control plane (0: none known); each
    # enforces 1/N of a tenant's rate_limit (`rate_limits.mode: local`, issue 19).
    inbound_sidecars: int = 0


@dataclass(frozen=True)
class Rollout:
    service: str
    stable: str
    canary: str
    steps: tuple[int, ...]
    interval: float
    threshold: int
    gates: dict[str, Any]
    ack_timeout: float = 10.0


@dataclass(frozen=True)
class ControlPlaneConfig:
    grpc_port: int = 18000
    admin_port: int = 18001
    debounce: float = 0.1
    # A sidecar that leaves a push un-ACKed this long is reported lagging and no longer holds
    # changes back (the ACK quorum leaves it out).
    lagging_after: float = 30.0
    # The mesh CA's TLS ports (issue 14, only with an `identity` block): enrolment by join
    # token, and renewal by client certificate. None: grpc_port + 2 / + 3 (0 when it is 0).
    ca_port: int | None = None
    ca_mtls_port: int | None = None


@dataclass(frozen=True)
class Identity:
    """The mesh CA (xds_server/ca.py): SPIFFE trust domain, workload certificates' lifetime,
    and an optional user root (then the mesh CA is an intermediate of it)."""

    trust_domain: str = "meshlm.local"
    cert_ttl: float = 900.0
    root_cert_file: str | None = None
    root_key_file: str | None = None


@dataclass(frozen=True)
class Authz:
    mode: str = "none"  # wasm | native | none
    # native only: Envoy's api_key_auth compares plaintext keys, so they come from a file
    # (YAML: tenant -> key or [keys]) kept out of the mesh file.
    keys_file: str | None = None


RATE_LIMIT_MODES = ("local", "global")


@dataclass(frozen=True)
class RateLimits:
    """How tenants' `rate_limit` holds mesh-wide (issue 19). `local`: the control plane divides
    each limit among the live inbound sidecars of a service, and each enforces its share in its
    authz filter: no call leaves the sidecar. `global`: every call also asks the control
    plane's rate-limit service: exact, at one gRPC round trip per call."""

    mode: str = "local"


ACCESS_LOG_CALLS = ("all", "failures", "off")


@dataclass(frozen=True)
class AccessLog:
    """JSON access logs of the sidecar listeners (HCM `access_log`). `path` None: the sidecar's
    stdout (the supervisor's log); else a file every sidecar on the host appends to. Which
    calls each side logs: by default the caller sidecar every call (one line per call, with its
    request id and trace), the inbound sidecar the failed and denied ones (with the verified
    tenant): a line per hop for every call costs each hop its formatting (issue 19)."""

    enabled: bool = True
    path: str | None = None
    outbound: str = "all"  # one of ACCESS_LOG_CALLS
    inbound: str = "failures"


@dataclass(frozen=True)
class CallerSidecar:
    """A caller-side sidecar whose Envoy admin `/stats` (grpc_stats counters) the rollout gates
    read: the callers' view of the canary."""

    admin_url: str


@dataclass(frozen=True)
class Mesh:
    services: dict[str, Service]
    control_plane: ControlPlaneConfig = field(default_factory=ControlPlaneConfig)
    # A `wasm_filters.policy.Policy` once that module exists; the raw dict before.
    tenants: Any = None
    rollouts: dict[str, Rollout] = field(default_factory=dict)
    authz: Authz = field(default_factory=Authz)
    access_log: AccessLog = field(default_factory=AccessLog)
    rate_limits: RateLimits = field(default_factory=RateLimits)
    caller_sidecars: tuple[CallerSidecar, ...] = ()
    identity: Identity | None = None

    # -- mutations return a new, validated Mesh ------------------------------------------
    def with_weights(self, service: str, weights: dict[str, int]) -> Mesh:
        svc = self._service(service)
        path = f"services.{service}.route.weights"
        new = _check_weights(dict(weights), svc.versions, path)
        return self._replace_service(svc, route=dataclasses.replace(svc.route, weights=new))

    def with_pins(self, service: str, stable: str, canary: str) -> Mesh:
        """`x-canary: never` -> `stable`, `always` -> `canary` (the rollout controller's pair)."""
        svc = self._service(service)
        for key, v in (("stable", stable), ("canary", canary)):
            if v not in svc.versions:
                raise MeshError(
                    f"services.{service}.route.pins.{key}: unknown version {v!r} "
                    f"(known: {', '.join(svc.versions)})"
                )
        return self._replace_service(
            svc, route=dataclasses.replace(svc.route, pins=(stable, canary))
        )

    def with_endpoint(self, service: str, version: str, endpoint: str, *, add: bool) -> Mesh:
        svc = self._service(service)
        path = f"services.{service}.versions.{version}"
        if version not in svc.versions:
            raise MeshError(f"{path}: unknown version (known: {', '.join(svc.versions)})")
        ver = svc.versions[version]
        ep = parse_endpoint(endpoint, f"{path}.endpoints")
        if add:
            eps = ver.endpoints if ep in ver.endpoints else (*ver.endpoints, ep)
        else:
            if ep not in ver.endpoints:
                raise MeshError(f"{path}.endpoints: {ep} is not an endpoint")
            eps = tuple(e for e in ver.endpoints if e != ep)
        versions = {**svc.versions, version: dataclasses.replace(ver, endpoints=eps)}
        return self._replace_service(svc, versions=versions)

    def with_quarantined(self, service: str, entries: tuple[Quarantine, ...]) -> Mesh:
        svc = self._service(service)
        if entries and svc.isolation is None:
            raise MeshError(f"services.{service}.isolation: needed to quarantine a class")
        for q in entries:
            if not CLASS_KEY.match(q.key):
                raise MeshError(f"services.{service}.quarantined: {q.key!r} is not a class key")
        return self._replace_service(svc, quarantined=tuple(entries))

    def with_slo_state(self, service: str, state: SloState) -> Mesh:
        return self._replace_service(self._service(service), slo_state=state)

    def with_inbound_sidecars(self, service: str, count: int) -> Mesh:
        return self._replace_service(self._service(service), inbound_sidecars=count)

    def _service(self, name: str) -> Service:
        if name not in self.services:
            raise MeshError(f"services.{name}: unknown service (known: {', '.join(self.services)})")
        return self.services[name]

    def _replace_service(self, svc: Service, **changes: Any) -> Mesh:
        services = {**self.services, svc.name: dataclasses.replace(svc, **changes)}
        return dataclasses.replace(self, services=services)


# -- parsing --------------------------------------------------------------------------------


def load_mesh(path: str | Path) -> Mesh:
    return parse_mesh(load_yaml(Path(path).read_text(), str(path)))


def load_yaml(text: str | bytes, source: str = "mesh") -> Any:
    """YAML text -> plain data, refusing duplicate keys: YAML would keep only the last one, so a
    second `llm:` or tenant would silently replace the first."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is None:
            return None
        _no_duplicate_keys(node, "", set())
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise MeshError(f"{source}: not valid YAML: {e}") from None
    except RecursionError:
        raise MeshError(f"{source}: nested too deeply") from None


def _no_duplicate_keys(node: yaml.Node, path: str, seen: set[int]) -> None:
    if id(node) in seen:  # an alias: its anchor was checked already
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else "?"
            here = f"{path}.{field_name(key)}" if path else field_name(key)
            line = k.start_mark.line + 1
            if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                if (k.tag, key) in first:
                    raise MeshError(
                        f"{here}: duplicate key {key!r} at line {line} (first at line "
                        f"{first[(k.tag, key)]}); YAML would silently keep only the last"
                    )
                first[(k.tag, key)] = line
            _no_duplicate_keys(v, here, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _no_duplicate_keys(item, f"{path}[{i}]", seen)


def parse_mesh(raw: Any) -> Mesh:
    top = _mapping(raw, "mesh")
    _only(
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
        },
    )
    services_raw = _mapping(top.get("services"), "services")
    if not services_raw:
        raise MeshError("services: at least one service is required")
    services = {n: _service(n, v, f"services.{n}") for n, v in services_raw.items()}
    tenants = _tenants(top.get("tenants"), top.get("roles"))
    if tenants is not None:
        _check_allow_rules(top.get("tenants"), top.get("roles"), services)
    authz_raw = _mapping(top.get("authz", {}), "authz")
    _only(authz_raw, "authz", {"mode", "keys_file"})
    mode = authz_raw.get("mode", "wasm" if tenants else "none")
    if mode not in AUTHZ_MODES:
        raise MeshError(f"authz.mode: expected one of {', '.join(AUTHZ_MODES)}, got {mode!r}")
    if mode != "none" and not tenants:
        raise MeshError(f"authz.mode: {mode} needs a tenants section")
    keys_file = authz_raw.get("keys_file")
    if mode == "native" and not isinstance(keys_file, str):
        raise MeshError("authz.keys_file: native mode needs a file of plaintext keys per tenant")
    rollouts_raw = _mapping(top.get("rollouts", {}), "rollouts")
    rollouts = {n: _rollout(n, v, services, f"rollouts.{n}") for n, v in rollouts_raw.items()}
    return Mesh(
        services=services,
        control_plane=_control_plane(top.get("control_plane", {})),
        tenants=tenants,
        rollouts=rollouts,
        authz=Authz(mode=mode, keys_file=keys_file if mode == "native" else None),
        access_log=_access_log(top.get("access_log", True)),
        rate_limits=_rate_limits(top.get("rate_limits")),
        caller_sidecars=_caller_sidecars(top.get("caller_sidecars")),
        identity=_opt(top, "identity", "mesh", lambda d, _p: _identity(d)),
    )


# A SPIFFE trust domain (lower case) and the path segments of a service account.
TRUST_DOMAIN = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
SERVICE_ACCOUNT = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*/[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
# Workload certificates live 10 s (tests) to a day; 15 minutes by default (Istio: 24 h).
CERT_TTL_RANGE = (10.0, 86400.0)


def _identity(d: dict) -> Identity:
    """`identity: {trust_domain, cert_ttl, root: {cert_file, key_file}}`, all optional."""
    _only(d, "identity", {"trust_domain", "cert_ttl", "root"})
    td = d.get("trust_domain", "meshlm.local")
    if not isinstance(td, str) or not TRUST_DOMAIN.match(td) or len(td) > 255:
        raise MeshError(
            f"identity.trust_domain: expected lower-case letters, digits, . _ - (a SPIFFE trust "
            f"domain), got {td!r}"
        )
    ttl = parse_duration(d.get("cert_ttl", "15m"), "identity.cert_ttl")
    lo, hi = CERT_TTL_RANGE
    if not lo <= ttl <= hi:
        raise MeshError(f"identity.cert_ttl: must be {lo:g}s to {hi / 3600:g}h, got {ttl:g}s")
    root = _mapping(d.get("root"), "identity.root")
    _only(root, "identity.root", {"cert_file", "key_file"})
    for key in ("cert_file", "key_file"):
        value = root.get(key)
        if root and (not isinstance(value, str) or not value):
            raise MeshError(f"identity.root.{key}: expected a file path, got {value!r}")
    return Identity(
        trust_domain=td,
        cert_ttl=ttl,
        root_cert_file=root.get("cert_file"),
        root_key_file=root.get("key_file"),
    )


def _caller_sidecars(raw: Any) -> tuple[CallerSidecar, ...]:
    """`caller_sidecars: [{admin_url: http://127.0.0.1:15000}, ...]`."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise MeshError("caller_sidecars: expected a list of {admin_url: URL}")
    out = []
    for i, item in enumerate(raw):
        path = f"caller_sidecars[{i}]"
        d = _mapping(item, path)
        _only(d, path, {"admin_url"})
        out.append(CallerSidecar(admin_url=_url(d.get("admin_url"), f"{path}.admin_url")))
    if len({c.admin_url for c in out}) != len(out):
        raise MeshError("caller_sidecars: duplicate admin_url")
    return tuple(out)


def _url(raw: Any, path: str) -> str:
    problem = url_problem(raw)
    if problem:
        raise MeshError(f"{path}: {problem}")
    return raw


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
    d = _mapping(raw, "access_log")
    _only(d, "access_log", {"path", "outbound", "inbound"})
    path = d.get("path")
    if path is not None and (not isinstance(path, str) or not path):
        raise MeshError(f"access_log.path: expected a file path, got {path!r}")
    sides = {}
    for side in ("outbound", "inbound"):
        calls = d.get(side, getattr(AccessLog, side))
        if calls not in ACCESS_LOG_CALLS:
            raise MeshError(
                f"access_log.{side}: expected one of {', '.join(ACCESS_LOG_CALLS)}, got {calls!r}"
            )
        sides[side] = calls
    return AccessLog(path=path, **sides)


def _rate_limits(raw: Any) -> RateLimits:
    d = _mapping(raw, "rate_limits")
    _only(d, "rate_limits", {"mode"})
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
    raw = _mapping(raw, "tenants")
    try:
        policy = importlib.import_module("wasm_filters.policy")
    except ModuleNotFoundError:
        return raw  # the policy model is not installed: keep the raw section
    try:
        return policy.parse_policy(raw, path="tenants", roles=roles, roles_path="roles")
    except ValueError as e:  # wasm_filters.policy.PolicyError names the field itself
        raise MeshError(str(e)) from None


def _control_plane(raw: Any) -> ControlPlaneConfig:
    d = _mapping(raw, "control_plane")
    _only(
        d,
        "control_plane",
        {"grpc_port", "admin_port", "debounce", "lagging_after", "ca_port", "ca_mtls_port"},
    )
    lagging_after = parse_duration(d.get("lagging_after", "30s"), "control_plane.lagging_after")
    if lagging_after <= 0:  # 0 would count every change as applied before any ACK
        raise MeshError("control_plane.lagging_after: must be more than 0s")
    return ControlPlaneConfig(
        grpc_port=_port(d.get("grpc_port", 18000), "control_plane.grpc_port", allow_zero=True),
        admin_port=_port(d.get("admin_port", 18001), "control_plane.admin_port", allow_zero=True),
        debounce=parse_duration(d.get("debounce", "100ms"), "control_plane.debounce"),
        lagging_after=lagging_after,
        ca_port=_opt_port(d, "ca_port"),
        ca_mtls_port=_opt_port(d, "ca_mtls_port"),
    )


def _opt_port(d: dict, key: str) -> int | None:
    return None if d.get(key) is None else _port(d[key], f"control_plane.{key}", allow_zero=True)


def _service(name: str, raw: Any, path: str) -> Service:
    _name(name, path)
    d = _mapping(raw, path)
    _only(
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
            "slo",
            "isolation",
            "service_account",
        },
    )
    vraw = _mapping(d.get("versions"), f"{path}.versions")
    if not vraw:
        raise MeshError(f"{path}.versions: at least one version is required")
    versions = {v: _version(v, x, f"{path}.versions.{v}") for v, x in vraw.items()}
    route = _route(d.get("route"), versions, f"{path}.route")
    return Service(
        name=name,
        versions=versions,
        route=route,
        load_balancing=_load_balancing(d.get("load_balancing"), route, f"{path}.load_balancing"),
        slo=_opt(d, "slo", path, _slo),
        outlier_detection=_opt(d, "outlier_detection", path, _outlier),
        circuit_breakers=_opt(d, "circuit_breakers", path, _circuit_breakers),
        retry_policy=_opt(d, "retry_policy", path, _retry_policy),
        health_check=_opt(d, "health_check", path, _health_check),
        stall=_opt(d, "stall", path, _stall),
        isolation=_opt(d, "isolation", path, lambda i, p: _isolation(i, p, route)),
        connect_timeout=_positive(d.get("connect_timeout", "1s"), f"{path}.connect_timeout"),
        service_account=_service_account(d.get("service_account"), name, path),
    )


def _service_account(raw: Any, service: str, path: str) -> str:
    if raw is None:
        return f"default/{service}"
    if not isinstance(raw, str) or not SERVICE_ACCOUNT.match(raw):
        raise MeshError(f"{path}.service_account: expected NAMESPACE/NAME, got {raw!r}")
    return raw


def _version(name: str, raw: Any, path: str) -> Version:
    _name(name, path)
    d = _mapping(raw, path)
    _only(d, path, {"precision", "endpoints", "metrics_urls"})
    precision = d.get("precision")
    if precision is not None and precision not in ("bf16", "fp16", "int4"):
        raise MeshError(f"{path}.precision: expected bf16, fp16 or int4, got {precision!r}")
    eps = d.get("endpoints", [])
    if not isinstance(eps, list):
        raise MeshError(f"{path}.endpoints: expected a list of host:port")
    endpoints = tuple(parse_endpoint(e, f"{path}.endpoints[{i}]") for i, e in enumerate(eps))
    if len(set(endpoints)) != len(endpoints):
        raise MeshError(f"{path}.endpoints: duplicate endpoint")
    urls = d.get("metrics_urls", [])
    if not isinstance(urls, list):
        raise MeshError(f"{path}.metrics_urls: expected a list of http(s) URLs")
    metrics = tuple(_url(u, f"{path}.metrics_urls[{i}]") for i, u in enumerate(urls))
    return Version(name=name, precision=precision, endpoints=endpoints, metrics_urls=metrics)


def parse_endpoint(raw: Any, path: str) -> Endpoint:
    """`ip:port` -> Endpoint; MeshError naming `path` otherwise."""
    if not isinstance(raw, str) or raw.count(":") != 1:
        raise MeshError(f"{path}: expected host:port, got {raw!r}")
    host, port = raw.split(":")
    if not host:
        raise MeshError(f"{path}: empty host in {raw!r}")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        # Envoy's STATIC/EDS socket addresses take IPs only; a name would be NACKed later.
        raise MeshError(
            f"{path}: {host!r} is not an IPv4 address (Envoy endpoints need IPs, "
            "e.g. 127.0.0.1, not localhost)"
        ) from None
    try:
        p = int(port)
    except ValueError:
        raise MeshError(f"{path}: port {port!r} is not a number") from None
    return Endpoint(host, _port(p, path))


def _route(raw: Any, versions: dict[str, Version], path: str) -> Route:
    if raw is None:
        if len(versions) != 1:
            raise MeshError(f"{path}.weights: required when a service has several versions")
        return Route(weights={next(iter(versions)): 100})
    d = _mapping(raw, path)
    _only(
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
    weights = _check_weights(
        _mapping(d.get("weights"), f"{path}.weights"), versions, path + ".weights"
    )
    hp = None
    if "hash_policy" in d:
        h = _mapping(d["hash_policy"], f"{path}.hash_policy")
        _only(h, f"{path}.hash_policy", {"header"})
        header = h.get("header")
        if not isinstance(header, str) or not header:
            raise MeshError(f"{path}.hash_policy.header: expected a header name")
        hp = HashPolicy(header=header.lower())
    use_hash = d.get("use_hash_policy", False)
    if not isinstance(use_hash, bool):
        raise MeshError(f"{path}.use_hash_policy: expected true or false, got {use_hash!r}")
    if use_hash and hp is None:
        raise MeshError(f"{path}.use_hash_policy: needs a hash_policy (the header to hash)")
    canary_header = d.get("canary_header", "x-canary")
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


def _slo(d: dict, path: str) -> Slo:
    keys = {"ttft_p99", "tpot_p99", "success_rate", "interval", "deviation", "intervals"}
    _only(d, path, keys | {"recover_intervals", "actions", "max_replicas", "min_requests"})
    if not keys & {"ttft_p99", "tpot_p99", "success_rate"} & set(d):
        raise MeshError(f"{path}: needs at least one of ttft_p99, tpot_p99, success_rate")
    rate = d.get("success_rate")
    if rate is not None and (
        isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < 100
    ):
        raise MeshError(f"{path}.success_rate: expected a percentage above 0, below 100")
    dev = _rate(d.get("deviation", "15%"), f"{path}.deviation")
    n = _int(d.get("intervals", 3), f"{path}.intervals", 1, 100)
    actions = d.get("actions", list(SLO_ACTIONS))
    if not isinstance(actions, list) or not actions:
        raise MeshError(f"{path}.actions: expected a list of {', '.join(SLO_ACTIONS)}")
    for i, a in enumerate(actions):
        if a not in SLO_ACTIONS:
            raise MeshError(f"{path}.actions[{i}]: expected one of {', '.join(SLO_ACTIONS)}")
    if len(set(actions)) != len(actions):
        raise MeshError(f"{path}.actions: an action is listed twice")
    return Slo(
        ttft_p99=None if "ttft_p99" not in d else _positive(d["ttft_p99"], f"{path}.ttft_p99"),
        tpot_p99=None if "tpot_p99" not in d else _positive(d["tpot_p99"], f"{path}.tpot_p99"),
        success_rate=None if rate is None else float(rate),
        interval=_positive(d.get("interval", "10s"), f"{path}.interval"),
        deviation=dev,
        intervals=n,
        # Hysteresis: undoing takes twice as long as acting unless said otherwise.
        recover_intervals=_int(
            d.get("recover_intervals", 2 * n), f"{path}.recover_intervals", n, 1000
        ),
        actions=tuple(actions),
        max_replicas=_int(d.get("max_replicas", 1), f"{path}.max_replicas", 1, 16),
        min_requests=_int(d.get("min_requests", 10), f"{path}.min_requests", 0, 1_000_000),
    )


def _check_weights(weights: dict[str, Any], versions: dict[str, Version], path: str) -> dict:
    if not weights:
        raise MeshError(f"{path}: at least one weight is required")
    for v, w in weights.items():
        if v not in versions:
            raise MeshError(f"{path}.{v}: unknown version (known: {', '.join(versions)})")
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= 100:
            raise MeshError(f"{path}.{v}: expected an integer 0..100, got {w!r}")
    total = sum(weights.values())
    if total != 100:
        raise MeshError(f"{path}: weights must sum to 100, got {total}")
    # Versions left out get 0: the dict always names every version, in file order.
    return {v: int(weights.get(v, 0)) for v in versions}


def _outlier(d: dict, path: str) -> OutlierDetection:
    _only(
        d,
        path,
        {
            "consecutive_5xx",
            "consecutive_gateway_failure",
            "interval",
            "base_ejection_time",
            "max_ejection_percent",
            "failure_percentage_threshold",
            "failure_percentage_minimum_hosts",
            "failure_percentage_request_volume",
        },
    )
    fp = "failure_percentage"
    return OutlierDetection(
        failure_percentage_threshold=(
            None
            if d.get(f"{fp}_threshold") is None
            else _int(d[f"{fp}_threshold"], f"{path}.{fp}_threshold", 1, 100)
        ),
        failure_percentage_minimum_hosts=_int(
            d.get(f"{fp}_minimum_hosts", 2), f"{path}.{fp}_minimum_hosts", 1
        ),
        failure_percentage_request_volume=_int(
            d.get(f"{fp}_request_volume", 10), f"{path}.{fp}_request_volume", 1
        ),
        consecutive_5xx=_opt_int(d, "consecutive_5xx", path, 1),
        consecutive_gateway_failure=_opt_int(d, "consecutive_gateway_failure", path, 1),
        interval=parse_duration(d.get("interval", "10s"), f"{path}.interval"),
        base_ejection_time=parse_duration(
            d.get("base_ejection_time", "30s"), f"{path}.base_ejection_time"
        ),
        max_ejection_percent=_int(
            d.get("max_ejection_percent", 10), f"{path}.max_ejection_percent", 0, 100
        ),
    )


def _circuit_breakers(d: dict, path: str) -> CircuitBreakers:
    keys = {"max_connections", "max_pending_requests", "max_requests", "max_retries"}
    _only(d, path, keys | {"retry_budget"})
    budget = None
    if "retry_budget" in d:
        b = _mapping(d["retry_budget"], f"{path}.retry_budget")
        _only(b, f"{path}.retry_budget", {"budget_percent", "min_retry_concurrency"})
        pct = b.get("budget_percent", 20.0)
        if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not 0 <= pct <= 100:
            raise MeshError(f"{path}.retry_budget.budget_percent: expected 0..100, got {pct!r}")
        budget = RetryBudget(
            budget_percent=float(pct),
            min_retry_concurrency=_int(
                b.get("min_retry_concurrency", 3), f"{path}.retry_budget.min_retry_concurrency", 0
            ),
        )
    return CircuitBreakers(**{k: _opt_int(d, k, path, 0) for k in keys}, retry_budget=budget)


def _retry_policy(d: dict, path: str) -> RetryPolicy:
    _only(d, path, {"retry_on", "num_retries", "per_try_timeout"})
    retry_on = d.get("retry_on", "unavailable,connect-failure")
    if not isinstance(retry_on, str):
        raise MeshError(f"{path}.retry_on: expected a comma-separated string")
    for tok in retry_on.split(","):
        if tok.strip() not in RETRY_ON:
            raise MeshError(f"{path}.retry_on: unknown condition {tok.strip()!r}")
    pt = d.get("per_try_timeout")
    return RetryPolicy(
        retry_on=",".join(t.strip() for t in retry_on.split(",")),
        num_retries=_int(d.get("num_retries", 1), f"{path}.num_retries", 0, 10),
        per_try_timeout=None if pt is None else parse_duration(pt, f"{path}.per_try_timeout"),
    )


def _isolation(d: dict, path: str, route: Route) -> Isolation:
    keys = {"error_rate", "window", "min_requests", "pool", "cooldown", "max_classes"}
    _only(d, path, keys | {"probe_percent"})
    if "error_rate" not in d:
        raise MeshError(f"{path}.error_rate: required, e.g. 0.8%")
    pool = d.get("pool")
    if pool is not None:
        if not isinstance(pool, str) or pool not in route.weights:
            raise MeshError(
                f"{path}.pool: unknown version {pool!r} (known: {', '.join(route.weights)})"
            )
        if route.weights[pool]:  # else healthy traffic would share the quarantine pool
            raise MeshError(f"{path}.pool: version {pool} must have weight 0 in route.weights")
    return Isolation(
        error_rate=_rate(d["error_rate"], f"{path}.error_rate"),
        window=_positive(d.get("window", "10m"), f"{path}.window"),
        min_requests=_int(d.get("min_requests", 20), f"{path}.min_requests", 1, 1_000_000),
        pool=pool,
        cooldown=_positive(d.get("cooldown", "30s"), f"{path}.cooldown"),
        max_classes=_int(d.get("max_classes", 10_000), f"{path}.max_classes", 1, 1_000_000),
        probe_percent=_int(d.get("probe_percent", 10), f"{path}.probe_percent", 1, 100),
    )


def _rate(raw: Any, path: str) -> float:
    """`0.8%` or a fraction like 0.008 -> 0.008; it must be more than 0 and at most 100 %."""
    if isinstance(raw, str) and raw.strip().endswith("%"):
        try:
            value = float(raw.strip()[:-1]) / 100.0
        except ValueError:
            value = None
    elif isinstance(raw, (int, float)) and not isinstance(raw, bool):
        value = float(raw)
    else:
        value = None
    if value is None or not 0.0 < value <= 1.0:  # NaN fails too
        raise MeshError(f"{path}: expected a rate like 0.8% or 0.008 (above 0, at most 100%)"
                        f", got {raw!r}")  # fmt: skip
    return value


def _stall(d: dict, path: str) -> Stall:
    _only(d, path, {"gap", "consecutive", "hard_limit", "max_resumes"})
    stall = Stall(
        gap=_positive(d.get("gap", "1s"), f"{path}.gap"),
        consecutive=_int(d.get("consecutive", 3), f"{path}.consecutive", 1, 100),
        hard_limit=_positive(d.get("hard_limit", "10s"), f"{path}.hard_limit"),
        max_resumes=_int(d.get("max_resumes", 2), f"{path}.max_resumes", 0, 10),
    )
    return _stall_checked(stall, path, MeshError)


def _stall_checked(stall: Stall, path: str, error: type[ValueError]) -> Stall:
    if not 0.001 <= stall.gap < stall.hard_limit <= 3600:
        raise error(f"{path}.hard_limit: must be more than gap (at least 1ms) and at most 1h")
    if not (1 <= stall.consecutive <= 100 and 0 <= stall.max_resumes <= 10):
        raise error(f"{path}: consecutive must be 1..100 and max_resumes 0..10")
    return stall


def _health_check(d: dict, path: str) -> HealthCheck:
    keys = {"interval", "no_traffic_interval", "timeout", "unhealthy_threshold"}
    _only(d, path, keys | {"healthy_threshold", "service_name"})
    interval = _positive(d.get("interval", "5s"), f"{path}.interval")
    return HealthCheck(
        interval=interval,
        no_traffic_interval=_positive(
            d.get("no_traffic_interval", interval), f"{path}.no_traffic_interval"
        ),
        timeout=_positive(d.get("timeout", "1s"), f"{path}.timeout"),
        unhealthy_threshold=_int(d.get("unhealthy_threshold", 2), f"{path}.unhealthy_threshold", 1),
        healthy_threshold=_int(d.get("healthy_threshold", 1), f"{path}.healthy_threshold", 1),
        service_name=str(d.get("service_name", "")),
    )


def _positive(raw: Any, path: str) -> float:
    v = parse_duration(raw, path)
    if v <= 0:
        raise MeshError(f"{path}: must be greater than 0")
    return v


def _rollout(name: str, raw: Any, services: dict[str, Service], path: str) -> Rollout:
    if name not in services:
        raise MeshError(f"{path}: unknown service (known: {', '.join(services)})")
    d = _mapping(raw, path)
    _only(d, path, {"stable", "canary", "steps", "interval", "threshold", "gates", "ack_timeout"})
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
        _int(s, f"{path}.steps[{i}]", 1, 100)
        if i and s <= steps[i - 1]:
            raise MeshError(f"{path}.steps[{i}]: steps must be ascending")
    gates = _mapping(d.get("gates", {}), f"{path}.gates")
    try:
        parse_rollout(name, d)  # the controller's own validator: gate names and values
    except RolloutSpecError as e:
        raise MeshError(str(e)) from None
    return Rollout(
        service=name,
        stable=d["stable"],
        canary=d["canary"],
        steps=tuple(steps),
        interval=parse_duration(d.get("interval", "30s"), f"{path}.interval"),
        threshold=_int(d.get("threshold", 2), f"{path}.threshold", 1),
        gates=dict(gates),
        ack_timeout=parse_duration(d.get("ack_timeout", "10s"), f"{path}.ack_timeout"),
    )


# -- small checkers ------------------------------------------------------------------------


def _mapping(raw: Any, path: str) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise MeshError(f"{path}: expected a mapping, got {type(raw).__name__}")
    for k in raw:
        if not isinstance(k, str):
            raise MeshError(f"{path}: keys must be strings, got {k!r}")
    return raw


def field_name(key: object) -> str:
    """A key as one segment of an error's field path: plain names as they are, anything else
    quoted with its `:` escaped, so the path still ends at the first `: `."""
    if isinstance(key, str) and _NAME.match(key):
        return key
    return json.dumps(str(key)).replace(":", "\\u003a")


def _only(d: dict, path: str, allowed: set[str]) -> None:
    for k in d:
        if k not in allowed:
            raise MeshError(
                f"{path}.{field_name(k)}: unknown field (allowed: {', '.join(sorted(allowed))})"
            )


def _name(name: str, path: str) -> None:
    if not _NAME.match(name) or "|" in name:
        if path.endswith(f".{name}"):  # the path ends with the bad name itself: quote it
            path = f"{path[: -len(name) - 1]}.{field_name(name)}"
        raise MeshError(f"{path}: invalid name {name!r} (letters, digits, _ . -)")


def _int(v: Any, path: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise MeshError(f"{path}: expected an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise MeshError(f"{path}: {v} out of range {lo}..{hi if hi is not None else ''}")
    return v


def _opt_int(d: dict, key: str, path: str, lo: int) -> int | None:
    return None if d.get(key) is None else _int(d[key], f"{path}.{key}", lo)


def _port(v: Any, path: str, *, allow_zero: bool = False) -> int:
    return _int(v, path, 0 if allow_zero else 1, 65535)


def _opt(d: dict, key: str, path: str, fn: Any) -> Any:
    if d.get(key) is None:
        return None
    return fn(_mapping(d[key], f"{path}.{key}"), f"{path}.{key}")

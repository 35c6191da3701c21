"""The validated, frozen desired state a mesh file parses to (names follow Envoy's API:
`outlier_detection`, `circuit_breakers`, `retry_budget`, `hash_policy`), and its mutations,
each of which returns a new, validated `Mesh`."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any

from mesh_common.headers import CANARY_HEADER, STALL_HEADER
from xds_server.mesh.fields import (
    MeshError,
    read_port,
)
from xds_server.mesh.locality import Locality

# x-meshlm-class: a hash of the request, never its text.
CLASS_KEY = re.compile(r"^[0-9a-f]{16}\Z")


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
# reports (Envoy's client_side_weighted_round_robin), ring_hash follows route.hash_policy,
# prefix_aware is a Maglev hash on the caller's prompt-prefix key (mesh_common.headers
# PREFIX_HEADER) with bounded load, so calls sharing a prompt prefix find its KV cache.
LOAD_BALANCING = ("least_loaded", "round_robin", "ring_hash", "prefix_aware")
# prefix_aware's bounded load (Envoy's hash_balance_factor, percent): a host takes a key's call
# while its active calls stay within this share of the mean; past it the call probes on. 110,
# not 150: with 150 a replica at half speed kept 38-40 % of calls without shared prefixes
# (hot-replica), 35 % with 110 (least_loaded: 33 %), while groups sharing a document still kept
# to one replica each (shared-prefix hit ratio 0.98 with 110, 0.95 with 150; BENCHMARKS.md).
HASH_BALANCE_FACTOR = 110


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    # The mesh file's `{address, zone}` form; not part of the host's identity (equality, hash).
    zone: str | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class RegisteredEndpoint:
    """A host that registered itself with the control plane (xds_server/registry/): live data,
    never in a mesh file. `healthy` follows its runtime's gRPC health."""

    endpoint: Endpoint
    zone: str | None = None
    weight: int | None = None
    healthy: bool = True


@dataclass(frozen=True)
class Version:
    name: str
    precision: str | None
    endpoints: tuple[Endpoint, ...]
    # The runtimes' `GET /metrics.json` (TTFT/TPOT), read by rollout gates when this version is the
    # canary. Only the operator names them: a sidecar's own announcements are never read.
    metrics_urls: tuple[str, ...] = ()
    # The hosts that registered for this version, laid over the mesh by the control plane before
    # each change is staged (as `inbound_sidecars` is); the static `endpoints` stay the file's.
    registered: tuple[RegisteredEndpoint, ...] = ()


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
    canary_header: str = CANARY_HEADER
    # Token streams: no route timeout; bound the whole stream and its idle gaps instead.
    max_stream_duration: float = 0.0  # 0 = unbounded
    stream_idle_timeout: float = 300.0
    # (stable, canary) for the `x-canary` pins, set by the rollout controller (a succeeded
    # rollout swaps them). None: the mesh file's rollout pair, else file order.
    pins: tuple[str, str] | None = None
    # The quality gate's mirror mode, set by the rollout controller while a step
    # runs: safe-marked calls are copied to this version's shadow cluster. Never in a mesh file.
    mirror: Mirror | None = None


@dataclass(frozen=True)
class Mirror:
    """Copy `percent` of the calls marked `x-meshlm-mirror: safe` to `version` (its shadow)."""

    version: str
    percent: float  # 0..100


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
    # Envoy's hedge_policy.hedge_on_per_try_timeout: a try past its per-try timeout is not
    # cancelled; the next try races it and the first response wins (needs per_try_timeout).
    hedge_on_per_try_timeout: bool = False


@dataclass(frozen=True)
class Stall:
    """Token-stall detection in the caller library: a stream with `consecutive`
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
        return checked_stall(stall, STALL_HEADER, ValueError)


SLO_ACTIONS = ("shed", "tighten_outlier", "scale_out")


@dataclass(frozen=True)
class Slo:
    """A service's objectives, evaluated every `interval` by the SLO loop (xds_server/slo/loop.py):
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
    """Semantic circuit breaking: a request class (`x-meshlm-class`) whose error rate
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
class Caller:
    """A workload that may call a service: `service_account` is
    `NAMESPACE/NAME`, or `NAMESPACE/*` for every account of a namespace; `methods` the gRPC
    methods it may call, () for all of them (xds_server/mesh/callers.py)."""

    service_account: str
    methods: tuple[str, ...] = ()


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
    # Bounded load for ring_hash / prefix_aware (percent of the mean load, >= 100); None: none.
    hash_balance_factor: int | None = None
    slo: Slo | None = None
    slo_state: SloState = field(default_factory=SloState)
    isolation: Isolation | None = None
    quarantined: tuple[Quarantine, ...] = ()
    # Its workloads' identity, `NAMESPACE/NAME`; default `default/<service>`.
    service_account: str = ""
    # The workloads that may call it (Envoy RBAC principals); None: any workload of the trust
    # domain, () nobody.
    callers: tuple[Caller, ...] | None = None
    # Its live inbound sidecars, counted from ADS by the control plane (0: none known); each
    # enforces 1/N of a tenant's rate_limit (`rate_limits.mode: local`).
    inbound_sidecars: int = 0
    # Zone preference and failover order for its callers; None: every zone alike.
    locality: Locality | None = None
    # The model a request names in its `model` field to reach this service through a caller
    # sidecar without naming the service (routes._unmatched_vhost), and its other names.
    model: str | None = None
    aliases: tuple[str, ...] = ()

    @property
    def model_names(self) -> tuple[str, ...]:
        """The model and its aliases, as the mesh file spells them; () without a model."""
        return (self.model, *self.aliases) if self.model else ()


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
    quality: dict[str, Any] | None = None  # xds_server.mesh.quality_spec.QualityGate's fields


@dataclass(frozen=True)
class Registration:
    """`control_plane.registration`: workloads registering their own endpoints
    (xds_server/registry/). `enabled` None: on when the gRPC port is mTLS (an identity block
    with `mtls: strict`: a registration is believed for its certificate's service account
    only), off on a plaintext port, where turning it on trusts whoever reaches the port."""

    enabled: bool | None = None
    grace: float = 10.0  # a host whose registration stream ended unannounced stays this long
    max_per_service: int = 64
    max_total: int = 1024
    # The mesh spans hosts: a loopback address names the registering host only, so it is refused.
    multi_host: bool = False


@dataclass(frozen=True)
class ControlPlaneConfig:
    grpc_port: int = 18000
    admin_port: int = 18001
    debounce: float = 0.1
    # A sidecar that leaves a push un-ACKed this long is reported lagging and no longer holds
    # changes back (the ACK quorum leaves it out).
    lagging_after: float = 30.0
    # The mesh CA's TLS ports (only with an `identity` block): enrolment by join
    # token, and renewal by client certificate. None: grpc_port + 2 / + 3 (0 when it is 0).
    ca_port: int | None = None
    ca_mtls_port: int | None = None
    registration: Registration = field(default_factory=Registration)


MTLS_MODES = ("strict", "off")


@dataclass(frozen=True)
class Identity:
    """The mesh CA (xds_server/identity/ca.py): SPIFFE trust domain, workload certificates'
    lifetime,
    and an optional user root (then the mesh CA is an intermediate of it)."""

    trust_domain: str = "meshlm.local"
    cert_ttl: float = 900.0
    root_cert_file: str | None = None
    root_key_file: str | None = None
    # strict: every hop caller sidecar -> inbound sidecar is mTLS with SPIFFE ID checks on both
    # sides (xds_server/resources/tls.py); off: plaintext hops, certificates still issued.
    mtls: str = "strict"


@dataclass(frozen=True)
class Authz:
    mode: str = "none"  # wasm | native | none
    # native only: Envoy's api_key_auth compares plaintext keys, so they come from a file
    # (YAML: tenant -> key or [keys]) kept out of the mesh file.
    keys_file: str | None = None


RATE_LIMIT_MODES = ("local", "global")


@dataclass(frozen=True)
class RateLimits:
    """How tenants' `rate_limit` holds mesh-wide. `local`: the control plane divides
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
    tenant): a line per hop for every call costs each hop its formatting."""

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
    # Where a caller sidecar sends an OpenAI call (/v1/) whose Host names no service; None: the
    # only service when there is one (`openai_default`).
    default_service: str | None = None
    # The `faults:` block (xds_server/mesh/faults.py), by name.
    faults: dict[str, Any] = field(default_factory=dict)

    @property
    def openai_default(self) -> str | None:
        """The service that takes /v1/ calls whose Host names none: `default_service`, else the
        mesh's only service, else None (such a call gets a 404 naming the services)."""
        if self.default_service is not None:
            return self.default_service
        return next(iter(self.services)) if len(self.services) == 1 else None

    # -- mutations return a new, validated Mesh ------------------------------------------
    def with_weights(self, service: str, weights: dict[str, int]) -> Mesh:
        svc = self._service(service)
        path = f"services.{service}.route.weights"
        new = check_weights(dict(weights), svc.versions, path)
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

    def with_mirror(self, service: str, mirror: Mirror | None) -> Mesh:
        """Mirror safe-marked calls to `mirror.version` (None: mirror nothing)."""
        svc = self._service(service)
        path = f"services.{service}.route.mirror"
        if mirror is not None:
            if mirror.version not in svc.versions:
                raise MeshError(
                    f"{path}.version: unknown version {mirror.version!r} "
                    f"(known: {', '.join(svc.versions)})"
                )
            if not 0 <= mirror.percent <= 100:
                raise MeshError(f"{path}.percent: expected 0..100, got {mirror.percent!r}")
        return self._replace_service(svc, route=dataclasses.replace(svc.route, mirror=mirror))

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

    def with_registered(
        self, registered: dict[tuple[str, str], tuple[RegisteredEndpoint, ...]]
    ) -> Mesh:
        """Every version's `registered` hosts from `registered` ((service, version) -> hosts;
        a version left out has none); hosts of unknown services or versions are left out. The
        same Mesh when nothing changes."""
        mesh = self
        for svc in self.services.values():
            versions = {
                v: dataclasses.replace(ver, registered=registered.get((svc.name, v), ()))
                for v, ver in svc.versions.items()
            }
            if versions != svc.versions:
                mesh = mesh._replace_service(svc, versions=versions)
        return mesh

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
    return Endpoint(host, read_port(p, path))


def check_weights(weights: dict[str, Any], versions: dict[str, Version], path: str) -> dict:
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


def checked_stall(stall: Stall, path: str, error: type[ValueError]) -> Stall:
    if not 0.001 <= stall.gap < stall.hard_limit <= 3600:
        raise error(f"{path}.hard_limit: must be more than gap (at least 1ms) and at most 1h")
    if not (1 <= stall.consecutive <= 100 and 0 <= stall.max_resumes <= 10):
        raise error(f"{path}: consecutive must be 1..100 and max_resumes 0..10")
    return stall

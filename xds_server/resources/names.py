"""Resource names, Istio style. Stable: tests, dashboards and the rollout controller key on them."""

AUTHZ_FILTER = "meshlm.authz"
OUTBOUND_LISTENER = "outbound"
OUTBOUND_ROUTE = "outbound"
TENANT_HEADER = "x-meshlm-tenant"
# The caller's verified SPIFFE ID (its mTLS certificate), for the runtime.
PRINCIPAL_HEADER = "x-meshlm-principal"
# Set by the authz filter alone; inbound listeners drop client-sent ones before any filter.
IDENTITY_HEADERS = (TENANT_HEADER, "x-meshlm-priority", PRINCIPAL_HEADER)
# The request class (a hash), set by the caller-side sidecar; isolation routes match it.
CLASS_HEADER = "x-meshlm-class"
# The quality gate's mirroring: a caller marks a call safe to copy to the canary
# (greedy, no side effects); Envoy appends SHADOW_SUFFIX to a copy's :authority, and only then
# does the canary's inbound sidecar set SHADOW_HEADER toward its runtime.
MIRROR_HEADER = "x-meshlm-mirror"
MIRROR_SAFE = "safe"
SHADOW_SUFFIX = "-shadow"
SHADOW_HEADER = "x-meshlm-shadow"


def outbound_cluster(service: str, version: str) -> str:
    return f"outbound|{service}|{version}"


def shadow_cluster(service: str, version: str) -> str:
    """The mirror's copy of a version's outbound cluster: same hosts, its own stats, so the
    traffic gates' counters of `outbound_cluster` never count a shadow."""
    return f"outbound|{service}|{version}|shadow"


def inbound_cluster(service: str, version: str) -> str:
    return f"inbound|{service}|{version}"


def inbound_http_cluster(service: str, version: str) -> str:
    """The runtime's OpenAI HTTP API behind an inbound listener."""
    return f"inbound|{service}|{version}|http"


def inbound_orca_cluster(service: str, version: str) -> str:
    """The runtime's gRPC port again, for ORCA report streams alone (their own breaker)."""
    return f"inbound|{service}|{version}|orca"


def inbound_listener(service: str, version: str) -> str:
    return f"inbound|{service}|{version}"


def inbound_route(service: str, version: str) -> str:
    return f"inbound|{service}|{version}"

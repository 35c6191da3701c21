"""Resource names, Istio style. Stable: tests, dashboards and the rollout controller key on them."""

AUTHZ_FILTER = "meshlm.authz"
OUTBOUND_LISTENER = "outbound"
OUTBOUND_ROUTE = "outbound"
# The quality gate's mirroring: Envoy appends SHADOW_SUFFIX to a mirrored copy's :authority, and
# only then does the canary's inbound sidecar set the shadow header (mesh_common/headers.py).
SHADOW_SUFFIX = "-shadow"


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

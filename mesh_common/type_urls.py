"""Type URLs of the xDS resources the control plane serves and the sidecar's SDS serves, of the
typed configs more than one package builds, and the order a change is pushed in (make before
break)."""

CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
EXTENSION_CONFIG = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
SECRET = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"  # SDS
WASM = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"  # an ECDS filter's config

# CDS, EDS, LDS, ECDS (the listener's filter config), RDS: envoy xDS protocol "eventual
# consistency considerations": a cluster exists before routes point at it.
PUSH_ORDER = (CLUSTER, ENDPOINT, LISTENER, EXTENSION_CONFIG, ROUTE)
# Types where an empty subscription in SotW means "everything" (wildcard).
WILDCARD_TYPES = frozenset({CLUSTER, LISTENER})

SHORT = {
    CLUSTER: "CDS",
    ENDPOINT: "EDS",
    LISTENER: "LDS",
    ROUTE: "RDS",
    EXTENSION_CONFIG: "ECDS",
}

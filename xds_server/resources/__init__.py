"""Envoy resources built from the mesh: `build.build_resources` gives one sidecar group's,
from the builders beside it (clusters, endpoints, listeners, routes, rbac, tls, access_log,
ratelimit)."""

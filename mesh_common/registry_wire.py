"""The workload registration stream's vocabulary, shared by the sidecar that registers
(sidecar/registration.py) and the control plane that keeps the registrations
(xds_server/registry/).

One bidirectional stream per registered host, on the control plane's gRPC port; its lifetime is
the lease. JSON messages, as the mesh CA's signing method takes (no generated code on either
side). The sidecar sends `{"register": {...}}` first, then `{"health": "SERVING"}` or
`{"health": "NOT_SERVING"}` as its runtime changes, and `{"deregister": {}}` before it drains;
the control plane answers each with `{"registered" | "health" | "deregistered": {...}}` once the
callers' sidecars hold the change (or a few seconds passed), and ends the stream after the
deregistration. A refusal ends the stream with a gRPC status whose message names the field.
"""

SERVICE = "meshlm.registry.v1.Registry"
METHOD = "Register"
REGISTER = f"/{SERVICE}/{METHOD}"

SERVING = "SERVING"
NOT_SERVING = "NOT_SERVING"
HEALTH = (SERVING, NOT_SERVING)

# The fields of `register`: where callers reach the host (its sidecar's inbound listener), what
# it serves, and its node id (for logs and status).
REGISTER_FIELDS = ("node_id", "address", "service", "version", "zone", "weight", "health")

MAX_MESSAGE = 4096  # bytes of one JSON message

"""The keys of a sidecar's node metadata: the sidecar's bootstrap writes them, the control plane
reads them to decide what the sidecar is sent (xds_server/xds/node.py)."""

SERVICE = "meshlm.service"
VERSION = "meshlm.version"
INBOUND_PORT = "meshlm.inbound_port"
OUTBOUND_PORT = "meshlm.outbound_port"
LOCAL_ENDPOINT = "meshlm.local_endpoint"  # host:port of the runtime an inbound listener fronts
LOCAL_HTTP_ENDPOINT = "meshlm.local_http_endpoint"  # that runtime's OpenAI HTTP API
LISTEN_HOST = "meshlm.listen_host"  # the address the sidecar's listeners bind
# ip:port callers reach the inbound listener at, where that is not LISTEN_HOST:INBOUND_PORT
# (a sidecar on 0.0.0.0 registering its pod IP): the host a mesh fault's `host:` names
HOST = "meshlm.host"

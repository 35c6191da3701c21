"""W3C trace context crosses the mesh: a `traceparent` the client sends reaches the runtime
unchanged through the caller sidecar and the runtime-side sidecar (Wasm authz), both real Envoys
fed by the control plane. The default access log of the caller sidecar (its stdout, a line per
call) carries it too, so a log line can be joined to the trace."""

from __future__ import annotations

from tests.test_mesh_support import ACME_KEY, json_lines, two_hops
from tests.test_xds_support import eventually

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "meshlm=t61rcWkgMzE"


def test_traceparent_reaches_the_runtime_through_two_sidecars() -> None:
    with two_hops() as mesh:
        md = [("x-api-key", ACME_KEY), ("traceparent", TRACEPARENT), ("tracestate", TRACESTATE)]
        echoed = eventually(lambda: mesh.call(md), what="a call through both sidecars")
        assert echoed["traceparent"] == TRACEPARENT
        assert echoed["tracestate"] == TRACESTATE
        assert echoed["x-meshlm-tenant"] == "acme" and "x-api-key" not in echoed

        def logged() -> list[dict]:
            text = mesh.caller.log_path.read_text()
            return [x for x in json_lines(text) if x.get("traceparent") == TRACEPARENT]

        (line,) = eventually(logged, what="the caller's access-log line on the sidecar's stdout")
        assert line["listener"] == "outbound" and line["grpc_status"] == 0
        assert ACME_KEY not in mesh.caller.log_path.read_text()

"""A connection storm: 2,000 simulated sidecars open their ADS streams at once, each on its own
connection, as a restarted control plane sees its fleet come back. gRPC's default of 1,000 calls
waiting to be taken up cancelled about a quarter of them; now every stream is admitted at the
bounded rate and none has to be reopened. Real control plane, real gRPC clients on loopback (the
bench's simulated sidecars, which ACK every response as Envoy does)."""

from __future__ import annotations

import time

from bench.bench_fleet import _all_acked, _clients
from bench.bench_xds import MESH, _client_errors
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.xds.sync import Limits

SIDECARS = 2_000
RATE = 1_000.0


def test_a_storm_of_streams_is_admitted_at_the_bounded_rate_and_none_reopened() -> None:
    cp = build_server(parse_mesh(MESH), debounce=0.0, limits=Limits(admit_per_s=RATE)).start()
    procs = _clients(cp.grpc_port, SIDECARS, "delta")
    try:
        t0 = time.monotonic()
        _all_acked(cp, SIDECARS, procs, timeout=180)
        took = time.monotonic() - t0
        nodes = cp.sync.to_json()["nodes"]
        # Stream numbers count every stream opened: one each, none opened twice.
        assert len(nodes) == SIDECARS and max(d["stream"] for d in nodes.values()) == SIDECARS
    finally:
        for p in procs:
            p.kill()
            p.wait()
        cp.stop()
    assert sum(_client_errors(p) for p in procs) == 0
    # A burst of RATE, then RATE a second: the rest cannot all be in sooner.
    assert took >= (SIDECARS - RATE) / RATE * 0.9

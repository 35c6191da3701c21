"""Delta (incremental) ADS against real Envoy: clusters added and removed, weights applied."""

from __future__ import annotations

from tests.test_xds_support import Caller, dynamic_clusters, eventually, sidecar, upstreams
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh


def _mesh(ups, *, embed: bool, weights=None) -> object:
    services = {
        "llm": {
            "versions": {
                "v1": {"endpoints": [ups["v1"].address]},
                "v2": {"endpoints": [ups["v2"].address]},
            },
            "route": {"weights": weights or {"v1": 100}},
        }
    }
    if embed:
        services["embed"] = {"versions": {"e1": {"endpoints": [ups["e1"].address]}}}
    return parse_mesh({"services": services})


def test_delta_adds_and_removes_clusters_and_routes_traffic() -> None:
    with upstreams("v1", "v2", "e1") as ups:
        cp = build_server(_mesh(ups, embed=False), debounce=0.02).start()
        envoy, port = sidecar(cp, "delta-1", api_type="DELTA_GRPC")
        try:
            with envoy:
                llm, embed = Caller(port, "llm"), Caller(port, "embed")
                assert llm.who() == "v1"
                assert dynamic_clusters(envoy) == {"outbound|llm|v1", "outbound|llm|v2"}
                assert cp.syncz()["nodes"]["delta-1"]["api"] == "delta"

                added = cp.update_mesh(_mesh(ups, embed=True), timeout=20)
                assert added.ok, added
                assert "outbound|embed|e1" in dynamic_clusters(envoy)
                assert embed.who() == "e1"

                shifted = cp.update_mesh(_mesh(ups, embed=True, weights={"v2": 100}), timeout=20)
                assert shifted.ok, shifted
                assert {llm.who() for _ in range(10)} == {"v2"}

                removed = cp.update_mesh(_mesh(ups, embed=False, weights={"v2": 100}), timeout=20)
                assert removed.ok, removed
                eventually(
                    lambda: "outbound|embed|e1" not in dynamic_clusters(envoy),
                    what="embed cluster removed",
                )
                assert dynamic_clusters(envoy) == {"outbound|llm|v1", "outbound|llm|v2"}
                assert llm.who() == "v2"
                eds = cp.syncz()["nodes"]["delta-1"]["types"]["EDS"]
                assert eds["acked_version"] == eds["sent_version"] and not eds["nack_error"]
                llm.close()
                embed.close()
        finally:
            cp.stop()

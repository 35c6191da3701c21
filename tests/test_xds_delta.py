"""Delta (incremental) ADS against real Envoy: clusters added and removed, weights applied."""

from __future__ import annotations

from mesh_common.ports import free_port
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


def test_a_restarted_control_plane_resends_nothing_a_delta_sidecar_holds() -> None:
    """Envoy reconnects with the content hashes of what it holds (initial_resource_versions); the
    new incarnation's versions differ, the content does not, so no resource is sent again. A
    state-of-the-world sidecar beside it gets every type again: the contrast."""
    with upstreams("v1", "v2") as ups:
        mesh = _mesh(ups, embed=False, weights={"v1": 50, "v2": 50})
        grpc_port = free_port()
        cp = build_server(mesh, debounce=0.02).start(grpc_port)
        delta, _ = sidecar(cp, "restart-delta", api_type="DELTA_GRPC")
        sotw, _ = sidecar(cp, "restart-sotw", api_type="GRPC")
        updates = r"\.update_success$"
        try:
            with delta, sotw:
                for node in ("restart-delta", "restart-sotw"):
                    eventually(lambda n=node: _converged(cp, n), what=f"{node} converged")
                before = {e: sum(e.stats(updates).values()) for e in (delta, sotw)}
                cp.stop(grace=0)
                cp = build_server(mesh, debounce=0.02).start(grpc_port)
                for node in ("restart-delta", "restart-sotw"):
                    eventually(lambda n=node: _converged(cp, n), what=f"{node} reconverged")
                eventually(
                    lambda: sum(sotw.stats(updates).values()) > before[sotw],
                    what="the SotW sidecar sent everything again",
                )
                assert before[delta] > 0 and sum(delta.stats(updates).values()) == before[delta]
        finally:
            cp.stop()


def _converged(cp, node: str) -> bool:
    """Every type the node asked for ACKed at this incarnation's version."""
    types = cp.syncz()["nodes"].get(node, {}).get("types", {})
    return len(types) >= 4 and all(
        ts["acked_version"].startswith(cp.incarnation) for ts in types.values()
    )

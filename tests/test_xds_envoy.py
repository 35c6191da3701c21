"""The control plane against real Envoy (state of the world ADS): boot from ADS alone, routed gRPC,
weights in real traffic, header pins, NACK handling, restart of the control plane."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import pytest

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_xds_support import (
    Caller,
    CallLoop,
    eventually,
    llm_mesh,
    sidecar,
    upstreams,
    with_unvalidated_endpoint,
)
from xds_server.compose import build_server


@pytest.fixture(scope="module")
def mesh_env() -> Iterator[dict]:
    with upstreams("v1", "v2", "runtime") as ups:
        runtime = ups.pop("runtime")
        cp = build_server(llm_mesh(ups), debounce=0.05).start()
        inbound = free_port()
        envoy, outbound = sidecar(
            cp,
            "caller-1",
            service="llm",
            version="v1",
            inbound_port=inbound,
            local_endpoint=runtime.address,
        )
        try:
            with envoy:
                caller = Caller(outbound)
                yield {
                    "cp": cp,
                    "envoy": envoy,
                    "caller": caller,
                    "inbound": Caller(inbound),
                    "ups": ups,
                }
                caller.close()
        finally:
            cp.stop()


def test_envoy_boots_from_ads_alone_and_routes_grpc(mesh_env: dict) -> None:
    cp, envoy = mesh_env["cp"], mesh_env["envoy"]
    assert mesh_env["caller"].who() == "v1"
    # The inbound listener fronts the local runtime of this sidecar's service version.
    assert mesh_env["inbound"].who() == "runtime"
    assert {"outbound|llm|v1", "outbound|llm|v2", "inbound|llm|v1"} <= _clusters(envoy)
    node = cp.syncz()["nodes"]["caller-1"]
    for short in ("CDS", "EDS", "LDS", "RDS"):
        ts = node["types"][short]
        assert ts["acked_version"] == ts["sent_version"]
        assert ts["acked_version"].startswith(cp.incarnation + ".")
    # Streaming-safe: no 15 s route timeout; grpc_stats sits before the router.
    routes = envoy.config_dump("dynamic_route_configs")["configs"]
    outbound = next(r for r in routes if r["route_config"]["name"] == "outbound")
    action = outbound["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]
    assert action["timeout"] == "0s"
    stats = envoy.stats("grpc")
    assert any("meshlm.inference.v1.Inference.Who.success" in k for k in stats), stats


def test_weight_change_shows_in_real_traffic(mesh_env: dict) -> None:
    cp, caller = mesh_env["cp"], mesh_env["caller"]
    result = cp.set_weights("llm", {"v1": 80, "v2": 20}, timeout=20)
    assert result.ok and result.acked == ["caller-1"], result
    n = 200
    seen = Counter(caller.who() for _ in range(n))
    # Binomial(200, 0.2): mean 40, sigma ~5.7; 5 sigma keeps a loaded box from flaking.
    sigma = math.sqrt(n * 0.2 * 0.8)
    assert abs(seen["v2"] - 40) <= 5 * sigma, seen
    assert seen["v1"] + seen["v2"] == n
    result = cp.set_weights("llm", {"v1": 0, "v2": 100}, timeout=20)
    assert result.ok, result
    assert {caller.who() for _ in range(20)} == {"v2"}
    assert cp.set_weights("llm", {"v1": 100}, timeout=20).ok


def test_canary_header_pins_a_version(mesh_env: dict) -> None:
    cp, caller = mesh_env["cp"], mesh_env["caller"]
    for weights in ({"v1": 100}, {"v1": 20, "v2": 80}):
        # The pins do not swap when the canary passes 50 %.
        assert cp.set_weights("llm", weights, timeout=20).ok
        assert {caller.who((("x-canary", "always"),)) for _ in range(10)} == {"v2"}
        assert {caller.who((("x-canary", "never"),)) for _ in range(10)} == {"v1"}
    assert cp.set_weights("llm", {"v1": 100}, timeout=20).ok


def test_grpc_health_check_ejects_a_not_serving_host() -> None:
    with upstreams("v1", health=True) as ups:
        mesh = llm_mesh(ups, health_check={"interval": "0.2s", "unhealthy_threshold": 1})
        cp = build_server(mesh, debounce=0.02).start()
        envoy, port = sidecar(cp, "hc-1")
        try:
            with envoy:
                caller = Caller(port)
                eventually(lambda: caller.who() == "v1", what="healthy host serves")
                ups["v1"].set_serving(False)
                eventually(
                    lambda: "failed_active_hc" in envoy.admin_get("/clusters"),
                    what="host failed the gRPC health check",
                )
                ups["v1"].set_serving(True)
                eventually(lambda: caller.who() == "v1", what="host back after health check")
                caller.close()
        finally:
            cp.stop()


def test_nacked_endpoint_is_recorded_not_resent_and_traffic_flows(mesh_env: dict) -> None:
    cp, envoy, caller = mesh_env["cp"], mesh_env["envoy"], mesh_env["caller"]
    good = cp.mesh
    before = cp.syncz()["nodes"]["caller-1"]["types"]["EDS"]
    # Envoy's EDS takes IP addresses only: a host name is NACKed.
    result = cp.update_mesh(
        with_unvalidated_endpoint(good, "v1", "llm-host.invalid", 50051), timeout=20
    )
    assert not result.ok and result.missing == ["caller-1"], result
    assert "malformed IP address" in result.errors["caller-1"], result.errors
    eds = cp.syncz()["nodes"]["caller-1"]["types"]["EDS"]
    assert eds["nack_version"] == result.version
    assert "malformed IP address" in eds["nack_error"]
    assert eds["acked_version"] == before["acked_version"]  # the last good config stays
    pushes = eds["pushes"]
    # Traffic keeps flowing on the last good config, and the rejected version is not resent.
    assert {caller.who() for _ in range(30)} == {"v1"}
    envoy.admin_get("/ready")
    assert cp.syncz()["nodes"]["caller-1"]["types"]["EDS"]["pushes"] == pushes
    # The fix is a new version, which is pushed and ACKed; the NACK is then history.
    fixed = cp.update_mesh(good, timeout=20)
    assert fixed.ok, fixed
    eds = cp.syncz()["nodes"]["caller-1"]["types"]["EDS"]
    assert eds["pushes"] == pushes + 1
    assert eds["nack_error"] == "" and "malformed IP address" in eds["recovered"]
    assert caller.who() == "v1"


def test_bad_change_is_rejected_before_any_push(mesh_env: dict) -> None:
    cp = mesh_env["cp"]
    gen = cp.cache.generation
    with pytest.raises(ValueError, match=r"services\.llm\.route\.weights\.v3: unknown version"):
        cp.set_weights("llm", {"v1": 50, "v3": 50})
    with pytest.raises(ValueError, match="must sum to 100"):
        cp.set_weights("llm", {"v1": 50, "v2": 20})
    assert cp.cache.generation == gen


def test_control_plane_restart_keeps_traffic_and_reconverges() -> None:
    with upstreams("v1", "v2") as ups:
        mesh = llm_mesh(ups, {"v1": 50, "v2": 50})
        grpc_port = free_port()
        cp = build_server(mesh, debounce=0.02).start(grpc_port)
        envoy, port = sidecar(cp, "restart-1")
        try:
            with envoy, CallLoop(port) as calls:
                eventually(lambda: calls.total() > 20, what="traffic before restart")
                first = cp.incarnation
                cp.stop(grace=0)
                n_down = calls.total()
                eventually(lambda: calls.total() > n_down + 20, what="traffic while down")
                cp = build_server(mesh, debounce=0.02).start(grpc_port)
                assert cp.incarnation != first
                # Envoy reconnects and ACKs the new incarnation's versions.
                eventually(
                    lambda: cp.syncz()["nodes"]["restart-1"]["types"]["RDS"][
                        "acked_version"
                    ].startswith(cp.incarnation),
                    what="reconverged after restart",
                )
                assert cp.set_weights("llm", {"v1": 100}, timeout=20).ok
                n = calls.total()
                eventually(lambda: calls.total() > n + 20, what="traffic after")
        finally:
            cp.stop()
        assert calls.failures == []
        assert calls.served["v1"] and calls.served["v2"]


def test_inbound_sidecar_for_unknown_service_is_reported() -> None:
    with upstreams("v1") as ups:
        cp = build_server(llm_mesh(ups), debounce=0.02).start()
        b = ads_bootstrap(
            "lost-1",
            xds_address=("127.0.0.1", cp.grpc_port),
            service="nope",
            version="v1",
            inbound_port=free_port(),
        )
        envoy = EnvoyProcess(b).start()
        try:
            err = eventually(
                lambda: cp.syncz()["nodes"].get("lost-1", {}).get("error"), what="error"
            )
            assert "unknown service 'nope'" in err
        finally:
            envoy.stop()
            cp.stop()


def _clusters(envoy: EnvoyProcess) -> set[str]:
    dump = envoy.config_dump("dynamic_active_clusters")
    return {c["cluster"]["name"] for c in dump.get("configs", [])}


@pytest.mark.parametrize("api_type", ["GRPC", "DELTA_GRPC"])
def test_removing_a_version_under_traffic_fails_no_request(api_type: str) -> None:
    """Make before break: the routes leave v2 before its cluster goes."""
    with upstreams("v1", "v2") as ups:
        cp = build_server(llm_mesh(ups, {"v1": 50, "v2": 50}), debounce=0.02).start()
        envoy, port = sidecar(cp, f"mbb-{api_type}", api_type=api_type)
        try:
            with envoy, CallLoop(port) as calls:
                eventually(lambda: calls.served["v2"] > 10, what="traffic on v2")
                only_v1 = llm_mesh({"v1": ups["v1"]})
                assert cp.update_mesh(only_v1, timeout=20).ok
                eventually(
                    lambda: "outbound|llm|v2" not in _clusters(envoy), what="v2 cluster gone"
                )
                n = calls.served["v1"]
                eventually(lambda: calls.served["v1"] > n + 20, what="traffic after removal")
        finally:
            cp.stop()
        assert calls.failures == []

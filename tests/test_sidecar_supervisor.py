"""Sidecar supervision against real Envoy and the real control plane: restart after a crash,
and last-known-good config when Envoy restarts while the control plane is down."""

from __future__ import annotations

from sidecar.bootstrap import ads_bootstrap
from sidecar.lkg import LastKnownGood
from sidecar.ports import free_port
from sidecar.supervisor import Supervisor
from tests.test_xds_support import Caller, eventually, llm_mesh, upstreams
from xds_server.control_plane import ControlPlane


def _supervisor(cp_port: int, lkg: LastKnownGood) -> tuple[Supervisor, int]:
    outbound = free_port()
    boot = ads_bootstrap(
        "caller-sv",
        xds_address=("127.0.0.1", cp_port),
        outbound_port=outbound,
        admin_port=free_port(),
    )
    sv = Supervisor("caller-sv", boot, ("127.0.0.1", cp_port), lkg=lkg, poll_interval=0.2)
    return sv, outbound


def test_crashed_envoy_is_restarted_and_serves_again() -> None:
    with upstreams("v1") as ups, ControlPlane(llm_mesh(ups), debounce=0.02) as cp:
        sv, port = _supervisor(cp.grpc_port, LastKnownGood())
        sv.start()
        try:
            sv.wait_ready()
            caller = Caller(port)
            assert eventually(lambda: caller.who() == "v1", what="routed via ADS")
            admin = sv.admin_port
            sv.envoy.kill()  # a crash
            eventually(lambda: sv.restarts == 1 and sv.ready, what="restarted")
            assert sv.mode == "ads" and sv.admin_port == admin
            assert eventually(lambda: caller.who() == "v1", what="routed after restart")
            caller.close()
        finally:
            sv.stop()
        assert sv.envoy.proc.poll() is not None


def test_envoy_restarted_while_control_plane_down_serves_last_known_good(tmp_path) -> None:
    with upstreams("v1", "v2") as ups:
        cp = ControlPlane(llm_mesh(ups, weights={"v1": 0, "v2": 100}), debounce=0.02).start()
        cp_port = cp.grpc_port
        lkg = LastKnownGood(tmp_path / "lkg.json")
        sv, port = _supervisor(cp_port, lkg)
        sv.start()
        try:
            sv.wait_ready()
            caller = Caller(port)
            assert eventually(lambda: caller.who() == "v2", what="routed via ADS")
            eventually(lambda: sv.saved_at is not None, what="last-known-good stored")
            cp.stop()
            sv.envoy.kill()
            eventually(lambda: sv.restarts == 1 and sv.ready, what="restarted")
            assert sv.mode == "lkg"
            # The accepted config, not a default: all traffic still goes to v2.
            assert [caller.who() for _ in range(10)] == ["v2"] * 10
            # The stored copy survives the supervisor too, in a file only its owner can read.
            assert LastKnownGood(tmp_path / "lkg.json").get("caller-sv") is not None
            assert (tmp_path / "lkg.json").stat().st_mode & 0o077 == 0

            cp = ControlPlane(llm_mesh(ups, weights={"v1": 100, "v2": 0}), debounce=0.02)
            cp.start(grpc_port=cp_port)
            eventually(lambda: sv.mode == "ads" and sv.ready, what="back on ADS")
            assert eventually(lambda: caller.who() == "v1", what="follows the control plane")
            caller.close()
        finally:
            sv.stop()
            cp.stop()

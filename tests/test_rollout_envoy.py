"""Rollouts end to end on real parts: the control plane (ADS) feeds a caller-side Envoy, which
splits real gRPC traffic between two real grpcio upstreams; the controller reads the gates from
that Envoy's `grpc_stats` counters and moves the weights through `ControlPlane.set_weights`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.rollout_upstreams import METHOD, Traffic, Upstream
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.rollout.controller import TERMINAL, RolloutController
from xds_server.rollout.gates.sources import mesh_sources
from xds_server.server import XdsServer

SPEC = {
    "service": "llm",
    "stable": "v1",
    "canary": "v2",
    "steps": [10, 40, 70, 100],
    "interval": "1.5s",
    "threshold": 2,
    "ack_timeout": "10s",
    "gates": {"grpc_success_rate_min": 99.0, "min_requests": 5},
}


def mesh(v1: int, v2: int):
    return parse_mesh(
        {
            "control_plane": {"debounce": "20ms"},
            "services": {
                "llm": {
                    "versions": {
                        "v1": {"endpoints": [f"127.0.0.1:{v1}"]},
                        "v2": {"endpoints": [f"127.0.0.1:{v2}"]},
                    },
                    "route": {"weights": {"v1": 100, "v2": 0}},
                }
            },
        }
    )


@contextmanager
def caller_mesh(v1: Upstream, v2: Upstream) -> Iterator[tuple[XdsServer, EnvoyProcess, str]]:
    """A started control plane and one caller-side Envoy that took its config over ADS."""
    cp = build_server(mesh(v1.port, v2.port)).start()
    listen = free_port()
    boot = ads_bootstrap("caller-0", xds_address=("127.0.0.1", cp.grpc_port), outbound_port=listen)
    try:
        with EnvoyProcess(boot) as envoy:
            yield cp, envoy, f"127.0.0.1:{listen}"
    finally:
        cp.stop()


def sources(envoy: EnvoyProcess):
    return mesh_sources([envoy.admin_url])


def wait_terminal(c: RolloutController, timeout: float = 45.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = c.status("llm")
        if st["state"] in TERMINAL:
            return st
        time.sleep(0.1)
    raise AssertionError(f"rollout did not finish: {c.status('llm')}")


def wait_connected(cp: XdsServer, node: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cp.syncz()["nodes"].get(node, {}).get("connected"):
            return
        time.sleep(0.05)
    raise AssertionError(f"{node} did not reconnect: {cp.syncz()}")


def observed_fractions(st: dict) -> dict[int, float]:
    """Canary share of the calls the caller-side Envoy routed, per step weight."""
    out = {}
    for t in st["traffic"]:
        n = t["canary_requests"] + (t["stable_requests"] or 0)
        if n:
            out[t["canary_weight"]] = t["canary_requests"] / n
    return out


def routed_to(target: str, n: int, header: str | None = None) -> dict[str, int]:
    ch = grpc.insecure_channel(target, options=[("grpc.default_authority", "llm")])
    call = ch.unary_unary(METHOD)
    md = (("x-canary", header),) if header else None
    out: dict[str, int] = {}
    try:
        for _ in range(n):
            name = call(b"x", timeout=5, metadata=md).decode()
            out[name] = out.get(name, 0) + 1
    finally:
        ch.close()
    return out


def run_rollout(cp, envoy, tmp_path: Path) -> dict:
    """SPEC from start to a terminal state, measured on `envoy`; the final status."""
    c = RolloutController(cp, str(tmp_path / "r.json"), sources(envoy), poll_s=0.05)
    try:
        c.start(SPEC)
        return wait_terminal(c)
    finally:
        c.close()


def test_healthy_canary_is_promoted_through_real_envoy(tmp_path: Path) -> None:
    with Upstream("v1") as v1, Upstream("v2") as v2, caller_mesh(v1, v2) as (cp, envoy, target):
        with Traffic(target, authority="llm") as traffic:
            st = run_rollout(cp, envoy, tmp_path)
        assert st["state"] == "Succeeded", st["message"]
        assert st["stable"] == "v2"
        assert [a["outcome"] for a in st["analyses"]] == ["pass", "pass", "pass"]
        # The split Envoy really applied at each step, within a statistical tolerance.
        fr = observed_fractions(st)
        assert set(fr) == {10, 40, 70}
        for weight, share in fr.items():
            assert abs(share - weight / 100) < 0.2, (weight, share, st["traffic"])
        assert traffic.codes.get("OK", 0) > 0 and set(traffic.codes) == {"OK"}
        # Every sidecar ACKed 100 % before Succeeded: all traffic now reaches v2.
        assert routed_to(target, 30) == {"v2": 30}
        assert cp.syncz()  # the control plane still answers its views


def test_faulty_canary_rolls_back_within_threshold_and_stays_at_its_step(tmp_path: Path) -> None:
    with (
        Upstream("v1") as v1,
        Upstream("v2", fail_percent=10) as v2,
        caller_mesh(v1, v2) as (cp, envoy, target),
        Traffic(target, authority="llm") as traffic,
    ):
        st = run_rollout(cp, envoy, tmp_path)
        assert st["state"] == "RolledBack", st["message"]
        assert "gRPC success rate" in st["message"] and "'14'" in st["message"]
        failed = [a for a in st["analyses"] if a["outcome"] == "fail"]
        assert len(failed) == SPEC["threshold"]  # rolled back at the threshold, not later
        assert {a["canary_weight"] for a in st["analyses"]} == {10}
        fr = observed_fractions(st)
        assert set(fr) == {10} and fr[10] < 0.25, st["traffic"]
        # 100 % back on v1 once the rollback was ACKed; testers can still pin the canary.
        calls_before = v2.calls
        assert routed_to(target, 30) == {"v1": 30}
        assert v2.calls == calls_before
        v2.fail_percent = 0
        assert routed_to(target, 5, header="always") == {"v2": 5}
        assert traffic.codes.get("UNAVAILABLE", 0) > 0


def test_control_plane_killed_mid_rollout_traffic_flows_and_rollout_resumes(tmp_path: Path) -> None:
    store = str(tmp_path / "r.json")
    grpc_port, listen = free_port(), free_port()
    with Upstream("v1") as v1, Upstream("v2") as v2:
        the_mesh = mesh(v1.port, v2.port)
        cp = build_server(the_mesh).start(grpc_port=grpc_port)
        boot = ads_bootstrap("caller-0", xds_address=("127.0.0.1", grpc_port), outbound_port=listen)
        try:
            with EnvoyProcess(boot) as envoy, Traffic(f"127.0.0.1:{listen}", authority="llm") as tr:
                c = RolloutController(cp, store, sources(envoy), poll_s=0.05)
                try:
                    c.start({**SPEC, "interval": "60s"})  # stays at 10 % until the restart
                finally:
                    c.close()
                cp.stop()  # the control plane dies mid-rollout
                before = v2.calls
                time.sleep(1.0)
                assert v2.calls > before  # Envoy keeps its last config: 10 % still flows
                cp = build_server(the_mesh).start(grpc_port=grpc_port)
                c = RolloutController(cp, store, sources(envoy), poll_s=0.05)
                try:
                    st = c.status("llm")
                    assert st["state"] == "Progressing" and st["canary_weight"] == 10
                    assert "restarted" in st["history"][-1]["reason"]
                    assert cp.mesh.services["llm"].route.weights == {"v1": 90, "v2": 10}
                    wait_connected(cp, "caller-0")
                    c.promote("llm")  # the resumed rollout is steerable as before
                    st = wait_terminal(c)
                finally:
                    c.close()
                assert st["state"] == "Succeeded", st["message"]
                assert routed_to(f"127.0.0.1:{listen}", 20) == {"v2": 20}
                assert set(tr.codes) == {"OK"}, tr.codes  # no failed call through it all
        finally:
            cp.stop()

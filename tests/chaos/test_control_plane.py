"""Chaos on the configuration path: an invalid push (NACK), the control plane killed during a
rollout and during a policy change, a sidecar's Envoy restarted while the control plane is down.
Tiny grpcio upstreams stand in for the runtime: the model adds nothing to these scenarios."""

from __future__ import annotations

import subprocess
import sys
import time

from mesh_common.ports import free_port
from meshlm.demo.procs import wait_until
from tests.chaos.harness import TOKEN, EchoUpstream, Mesh, children, echo_call, kill_pid
from tests.chaos.load import Load, failures, recovery
from tests.chaos.record import record
from tests.test_xds_support import with_unvalidated_endpoint
from wasm_filters.policy import hash_key
from xds_server.admin.api import AdminServer
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh

RATE = 20.0


def _services(ups: dict[str, EchoUpstream], weights: dict[str, int], **extra) -> dict:
    return {
        "llm": {
            "versions": {n: {"endpoints": [u.address]} for n, u in ups.items()},
            "route": {"weights": weights},
            "retry_policy": {"retry_on": "unavailable,connect-failure", "num_retries": 2},
            **extra,
        }
    }


def _caller(mesh: Mesh, admin: int | None = None) -> tuple[int, int]:
    port, admin = free_port(), admin or free_port()
    mesh.start_sidecar("caller", admin_port=admin, outbound_port=port)
    call = echo_call(port)
    wait_until(lambda: call() in ("v1", "v2"), 30, "caller routes llm")
    return port, admin


def test_invalid_config_is_nacked_traffic_continues_error_in_status(tmp_path) -> None:
    # The mesh validator refuses what Envoy would NACK (a host-name endpoint is a 400 at the
    # admin API), so the NACK itself is driven by a change built past the validator, pushed by
    # an in-process control plane that serves the same ADS and admin ports.
    t_start = time.monotonic()
    v1 = EchoUpstream("v1")
    mesh = Mesh(tmp_path, {"services": _services({"v1": v1}, {"v1": 100})})
    cp = build_server(parse_mesh(mesh.mesh), debounce=0.02).start(mesh.grpc_port)
    admin = AdminServer(cp, token=TOKEN, port=mesh.admin_port).start()
    try:
        port, _ = _caller(mesh)
        with Load(echo_call(port), RATE) as load:
            time.sleep(2)
            refused, _ = mesh.admin(
                "POST", "/v1/services/llm/versions/v1/endpoints", {"add": "bad.invalid:1"}
            )
            fault_at = time.monotonic()
            result = cp.update_mesh(
                with_unvalidated_endpoint(cp.mesh, "v1", "bad.invalid", 1), timeout=20
            )
            nack_seen = time.monotonic() - fault_at
            time.sleep(4)
        cli = subprocess.run(
            [sys.executable, "-m", "meshlm.cli", "status", "--admin", mesh_admin(mesh)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        lost = failures(load.snapshot())
        record(
            "test_invalid_config_is_nacked_traffic_continues_error_in_status",
            "Invalid config pushed (Envoy NACKs it)",
            load=f"{load.held()}, unary echo via caller Envoy",
            faults=[
                "EDS endpoint `bad.invalid:1` (host name, Envoy wants an IP): refused at the "
                "admin API, then pushed past the validator"
            ],
            by_status=load.by_status(),
            allowed_lost=len(lost),
            recovery_s=None,
            started=t_start,
            admin_reply=f"HTTP {refused}",
            nack_reported_after_s=round(nack_seen, 2),
            meshlm_status_shows_nack="NACK" in cli.stdout and "malformed IP" in cli.stdout,
        )
        assert refused == 400
        assert not result.ok and "malformed IP address" in str(result.errors), result.to_json()
        assert not lost, load.by_status()
        assert cli.returncode == 0 and "NACK" in cli.stdout and "malformed IP" in cli.stdout
    finally:
        mesh.stop()
        admin.stop()
        cp.stop()
        v1.stop()


def mesh_admin(mesh: Mesh) -> str:
    return f"http://127.0.0.1:{mesh.admin_port}"


def test_sidecar_envoy_restarted_while_control_plane_down_uses_last_known_good(tmp_path) -> None:
    t_start = time.monotonic()
    ups = {"v1": EchoUpstream("v1"), "v2": EchoUpstream("v2")}
    mesh = Mesh(tmp_path, {"services": _services(ups, {"v1": 0, "v2": 100})})
    try:
        mesh.start_control_plane()
        port, _admin = _caller(mesh)
        wait_until(lambda: (tmp_path / "caller.lkg").exists(), 30, "last-known-good stored")
        call = echo_call(port)
        with Load(call, RATE) as load:
            time.sleep(2)
            mesh.kill("xds-server")
            time.sleep(1)
            fault_at = time.monotonic()
            envoys = children(mesh.procs["caller"].popen.pid)
            assert envoys, "the sidecar runs its Envoy as a child"
            for pid in envoys:
                kill_pid(pid)  # a crash of the Envoy, not of the supervisor
            wait_until(lambda: set(children(mesh.procs["caller"].popen.pid)) - set(envoys),
                       30, "a new Envoy")  # fmt: skip
            wait_until(lambda: call(timeout=2) == "v2", 30, "the restarted Envoy routes")
            ready_at = time.monotonic()
            time.sleep(3)
            replies_ok = call() == "v2"
        out = load.snapshot()
        after = failures([o for o in out if o.start >= ready_at])
        during = failures([o for o in out if fault_at <= o.start < ready_at])
        log = mesh.procs["caller"].log_path.read_text(errors="replace")
        record(
            "test_sidecar_envoy_restarted_while_control_plane_down_uses_last_known_good",
            "Sidecar Envoy restarted while the control plane is down",
            load=f"{load.held()}, unary echo via caller Envoy (v2 at 100 %)",
            faults=["control plane SIGKILLed", "caller's Envoy SIGKILLed 1 s later"],
            by_status=load.by_status(),
            allowed_lost=len(after),
            recovery_s=recovery(out, fault_at),
            started=t_start,
            failed_while_the_only_envoy_was_down=len(during),
            lkg_boot_logged="last-known-good" in log or "lkg" in log,
            routes_to_v2_after_restart=replies_ok,
        )
        assert replies_ok and not after, load.by_status()
    finally:
        mesh.stop()
        for u in ups.values():
            u.stop()


def test_control_plane_killed_mid_rollout_traffic_flows_rollout_resumes(tmp_path) -> None:
    t_start = time.monotonic()
    ups = {"v1": EchoUpstream("v1"), "v2": EchoUpstream("v2")}
    admin = free_port()  # the caller's, where the rollout gates read (mesh caller_sidecars)
    callers = [{"admin_url": f"http://127.0.0.1:{admin}"}]
    mesh = Mesh(tmp_path, {"services": _services(ups, {"v1": 100, "v2": 0}),
                           "caller_sidecars": callers})  # fmt: skip
    spec = {
        "stable": "v1",
        "canary": "v2",
        "steps": [25, 50, 100],
        "interval": "2s",
        "threshold": 2,
        "gates": {"grpc_success_rate_min": 99.0, "min_requests": 5},
    }
    try:
        mesh.start_control_plane()
        port, _ = _caller(mesh, admin)
        with Load(echo_call(port), RATE) as load:
            time.sleep(1)
            status, reply = mesh.admin("POST", "/rollouts/llm", spec)
            assert status == 201, reply
            wait_until(lambda: mesh.admin("GET", "/rollouts/llm")[1]["weights"]["v2"] >= 25,
                       30, "first step")  # fmt: skip
            mesh.kill("xds-server")
            time.sleep(3)
            mesh.start_control_plane()
            back_at = time.monotonic()

            def done() -> bool:
                return mesh.admin("GET", "/rollouts/llm")[1]["state"] == "Succeeded"

            wait_until(done, 45, "rollout Succeeded after the restart")
            resumed_s = time.monotonic() - back_at
            time.sleep(1)
            final = {echo_call(port)() for _ in range(10)}
        state = mesh.admin("GET", "/rollouts/llm")[1]
        lost = failures(load.snapshot())
        record(
            "test_control_plane_killed_mid_rollout_traffic_flows_rollout_resumes",
            "Control plane killed during a rollout",
            load=f"{load.held()}, unary echo via caller Envoy",
            faults=["control plane SIGKILLed at the first step (25 %), restarted 3 s later"],
            by_status=load.by_status(),
            allowed_lost=len(lost),
            recovery_s=None,
            started=t_start,
            rollout_final_state=state["state"],
            rollout_done_after_restart_s=round(resumed_s, 1),
            replies_after=sorted(final),
        )
        assert not lost, load.by_status()
        assert final == {"v2"}
    finally:
        mesh.stop()
        for u in ups.values():
            u.stop()


TENANTS = {
    "acme": {"key_sha256": hash_key("chaos-acme-key"), "allow": ["llm/*"]},
    "old": {"key_sha256": hash_key("chaos-old-key"), "allow": ["llm/*"]},
}
NEW_TENANTS = {
    "acme": TENANTS["acme"],
    "beta": {"key_sha256": hash_key("chaos-beta-key"), "allow": ["llm/*"]},
}


def test_control_plane_killed_during_policy_change(tmp_path) -> None:
    t_start = time.monotonic()
    v1 = EchoUpstream("v1")
    inbound = free_port()
    services = {
        "llm": {
            "versions": {"v1": {"endpoints": [f"127.0.0.1:{inbound}"]}},
            "route": {"weights": {"v1": 100}},
            "retry_policy": {"retry_on": "unavailable,connect-failure", "num_retries": 2},
        }
    }
    mesh = Mesh(tmp_path, {"services": services, "tenants": TENANTS})
    try:
        mesh.start_control_plane()
        mesh.start_sidecar("llm-v1", admin_port=free_port(), service="llm", version="v1",
                           inbound_port=inbound, local_endpoint=v1.address)  # fmt: skip
        port, _ = _caller_with_key(mesh, "chaos-acme-key")
        old, beta = echo_call(port, key="chaos-old-key"), echo_call(port, key="chaos-beta-key")
        assert old() == "v1"
        with Load(echo_call(port, key="chaos-acme-key"), RATE) as load:
            time.sleep(2)
            mesh.kill("xds-server")
            fault_at = time.monotonic()
            # The operator changes the policy while the control plane is down.
            mesh.write_mesh({**mesh.mesh, "tenants": NEW_TENANTS})
            time.sleep(2)
            mesh.start_control_plane()
            wait_until(lambda: _code(beta) == "v1" and _code(old) == "UNAUTHENTICATED",
                       30, "the new policy enforced")  # fmt: skip
            applied_s = time.monotonic() - fault_at
            time.sleep(2)
        lost = failures(load.snapshot())
        record(
            "test_control_plane_killed_during_policy_change",
            "Control plane killed during a policy change",
            load=f"{load.held()}, tenant acme, caller Envoy -> inbound Envoy (Wasm authz)",
            faults=[
                "control plane SIGKILLed",
                "policy changed while it was down (tenant `old` revoked, `beta` added)",
                "control plane restarted 2 s later",
            ],
            by_status=load.by_status(),
            allowed_lost=len(lost),
            recovery_s=None,
            started=t_start,
            new_policy_enforced_after_kill_s=round(applied_s, 1),
        )
        assert not lost, load.by_status()
    finally:
        mesh.stop()
        v1.stop()


def _caller_with_key(mesh: Mesh, key: str) -> tuple[int, int]:
    port, admin = free_port(), free_port()
    mesh.start_sidecar("caller", admin_port=admin, outbound_port=port)
    call = echo_call(port, key=key)
    wait_until(lambda: call() == "v1", 30, "caller routes llm through authz")
    return port, admin


def _code(call) -> str:
    import grpc

    try:
        return call(timeout=5)
    except grpc.RpcError as e:
        return e.code().name

"""Chaos on the sidecar's supervisor (issue 9): `meshlm sidecar` killed with SIGKILL must take its
Envoy along so a restarted sidecar can bind; a sidecar on last-known-good config must move back
to the control plane without dropping a call."""

from __future__ import annotations

import time
from pathlib import Path

from meshlm.demo.procs import wait_until
from tests.chaos.harness import EchoUpstream, Mesh, children, echo_call, kill_pid
from tests.chaos.load import Load, failures, recovery
from tests.chaos.record import record
from tests.chaos.test_control_plane import RATE, _caller, _services


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_sidecar_supervisor_killed_no_orphan_envoy_restarted_sidecar_serves(tmp_path) -> None:
    t_start = time.monotonic()
    v1 = EchoUpstream("v1")
    mesh = Mesh(tmp_path, {"services": _services({"v1": v1}, {"v1": 100})})
    try:
        mesh.start_control_plane()
        port, admin = _caller(mesh)
        call = echo_call(port, timeout=2)
        (envoy,) = children(mesh.procs["caller"].popen.pid)
        with Load(call, RATE) as load:
            time.sleep(2)
            fault_at = time.monotonic()
            mesh.kill("caller")  # SIGKILL to `meshlm sidecar` only: Envoy is in its own session
            wait_until(lambda: not _alive(envoy), 10, "the sidecar's Envoy died with it")
            envoy_gone_s = time.monotonic() - fault_at
            mesh.start_sidecar("caller", admin_port=admin, outbound_port=port)
            wait_until(lambda: call() == "v1", 30, "the restarted sidecar routes")
            ready_at = time.monotonic()
            time.sleep(3)
        out = load.snapshot()
        after = failures([o for o in out if o.start >= ready_at])
        log = mesh.procs["caller"].log_path.read_text(errors="replace")
        record(
            "test_sidecar_supervisor_killed_no_orphan_envoy_restarted_sidecar_serves",
            "Sidecar supervisor (`meshlm sidecar`) killed with SIGKILL, then restarted",
            load=f"{load.held()}, unary echo via caller Envoy",
            faults=[
                "`meshlm sidecar` SIGKILLed (its Envoy is not signalled)",
                "the same sidecar command started again on the same ports",
            ],
            by_status=load.by_status(),
            allowed_lost=len(after),
            recovery_s=recovery(out, fault_at),
            started=t_start,
            orphan_envoy_left=_alive(envoy),
            envoy_gone_after_kill_s=round(envoy_gone_s, 2),
            failed_while_no_sidecar_ran=len(failures([o for o in out if o.start < ready_at])),
            restarted_sidecar_cannot_bind="cannot bind" in log or "already in use" in log,
        )
        assert not _alive(envoy) and not after, load.by_status()
        assert "already in use" not in log
    finally:
        mesh.stop()
        v1.stop()


def test_last_known_good_switch_back_to_control_plane_loses_no_call(tmp_path) -> None:
    t_start = time.monotonic()
    ups = {"v1": EchoUpstream("v1"), "v2": EchoUpstream("v2")}
    mesh = Mesh(tmp_path, {"services": _services(ups, {"v1": 0, "v2": 100})})
    try:
        mesh.start_control_plane()
        port, _admin = _caller(mesh)
        wait_until(lambda: (tmp_path / "caller.lkg").exists(), 30, "last-known-good stored")
        call = echo_call(port)
        sidecar = mesh.procs["caller"]
        with Load(call, RATE) as load:
            mesh.kill("xds-server")
            (old,) = children(sidecar.popen.pid)
            kill_pid(old)  # Envoy restarts while the control plane is down: last-known-good
            wait_until(lambda: set(children(sidecar.popen.pid)) - {old}, 30, "a new Envoy")
            wait_until(lambda: call(timeout=2) == "v2", 30, "last-known-good Envoy routes")
            time.sleep(2)
            on_ads = sidecar.log_path.read_text().count("envoy ready (ads")
            back_at = time.monotonic()
            mesh.start_control_plane()
            wait_until(lambda: sidecar.log_path.read_text().count("envoy ready (ads") > on_ads,
                       60, "back on ADS", sidecar)  # fmt: skip
            switched_s = time.monotonic() - back_at
            time.sleep(4)  # the last-known-good Envoy drains and exits meanwhile
            envoys = children(sidecar.popen.pid)
        out = load.snapshot()
        lost = failures([o for o in out if o.start >= back_at])
        record(
            "test_last_known_good_switch_back_to_control_plane_loses_no_call",
            "Sidecar on last-known-good config switches back when the control plane returns",
            load=f"{load.held()}, unary echo via caller Envoy (v2 at 100 %)",
            faults=[
                "control plane SIGKILLed, then caller's Envoy: restarted on last-known-good config",
                "control plane started again",
            ],
            by_status=load.by_status(),
            allowed_lost=len(lost),
            recovery_s=None,
            started=t_start,
            lost_during_switch_back=len(lost),
            sent_during_switch_back=len([o for o in out if o.start >= back_at]),
            control_plane_back_to_ads_s=round(switched_s, 2),
            how="Envoy hot restart (--restart-epoch, same --base-id): sockets handed over",
            envoys_left_after_switch=len(envoys),
        )
        assert not lost, load.by_status(lost)
        assert len(envoys) == 1  # the last-known-good Envoy has exited
    finally:
        mesh.stop()
        for u in ups.values():
            u.stop()

"""Registrations survive a restart of a control plane alone on its state dir: `meshlm xds-server`
as a real process, SIGKILLed and started again on the same ports and state; a real caller Envoy;
real gRPC upstreams stand for the registered hosts, registered by the sidecar's client
(sidecar/registration.py). A live host stays in the caller's EDS throughout and its calls keep
succeeding; a host that never registers again leaves once the grace period after the restart
ends."""

from __future__ import annotations

import stat
import time

from tests.registration_processes import (
    ControlPlaneProcess,
    EdsSampler,
    PacedCalls,
    caller_envoy,
    control_planes,
    eds_hosts,
    registration,
    write_mesh,
)
from tests.registration_support import reg_mesh
from tests.test_xds_support import eventually, upstreams
from xds_server.mesh import Endpoint
from xds_server.registry.journal import RegistrationFile
from xds_server.registry.request import Register
from xds_server.registry.table import Registry

GRACE = 8.0


def test_restart_keeps_live_hosts_in_eds_and_drops_hosts_that_never_return(tmp_path) -> None:
    mesh = write_mesh(tmp_path / "mesh.yaml", f"{GRACE:g}s")
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o755)  # an operator's dir, not private: the registrations get one of their own
    cp = ControlPlaneProcess(tmp_path, "alone", mesh, "--state-dir", str(state)).start()
    with upstreams("live", "gone", health=True) as ups, control_planes(cp):
        live, gone = ups["live"].address, ups["gone"].address
        envoy, port = caller_envoy("caller-1", [cp.xds])
        # The live host reconnects no sooner than 2 s after its stream breaks: later than the
        # caller's Envoy, which must not lose it meanwhile.
        clients = [
            registration("live-node", live, [cp.xds], backoff=(2.0, 2.0)).start(),
            registration("gone-node", gone, [cp.xds], backoff=(2.0, 2.0)).start(),
        ]
        try:
            with envoy:
                eventually(lambda: set(cp.registered()) == {live, gone}, 60, "both registered")
                eventually(lambda: len(eds_hosts(envoy)) == 2, 30, "both in the caller's EDS")
                with PacedCalls(port) as calls, EdsSampler([envoy], live) as sampler:
                    eventually(lambda: calls.served["live"] >= 5, what="calls reach the live host")
                    cp.kill()
                    clients[1].stop()  # this one never comes back
                    killed = time.monotonic()
                    cp.start()
                    eventually(lambda: clients[0].registrations == 2, 60, "registered again")
                    row = eventually(lambda: cp.registered().get(live), 10, "the live host")
                    # No moment without the live host in the caller's EDS, no failed call.
                    assert sampler.gaps == [], sampler.gaps[:3]
                    assert calls.failures == [], calls.failures[:3]
                    assert row["stream"] == "open" and row["health"] == "SERVING", row
                    # The one that never came back is held until the grace period ends.
                    held = cp.registered().get(gone)
                    assert held is not None and held["stream"] == "lost", cp.registered()
                    assert gone in eds_hosts(envoy), "held for the grace period"
                    eventually(lambda: gone not in cp.registered(), GRACE + 20, "gone expired")
                    eventually(lambda: gone not in eds_hosts(envoy), 10, "gone out of EDS")
                    assert time.monotonic() - killed >= GRACE - 1, "not before the grace period"
                    after = calls.served["live"]
                    eventually(lambda: calls.served["live"] >= after + 5, what="calls go on")
                assert sampler.samples > 20 and sampler.gaps == [], sampler.gaps[:3]
                assert calls.failures == [], calls.failures[:3]
                saved = state / "registrations" / "hosts.json"
                assert stat.S_IMODE(saved.stat().st_mode) == 0o600
                assert stat.S_IMODE(saved.parent.stat().st_mode) == 0o700
        finally:
            for c in clients:
                c.stop()
    assert "Traceback" not in cp.output(), cp.output()[-3000:]
    assert "2 registrations restored" in cp.output(), cp.output()[-3000:]
    assert "held since the restart, expired: it did not register again" in cp.output()


def test_a_registrations_file_that_is_not_one_is_moved_aside_and_named(tmp_path, caplog) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    path = state / "registrations.json"
    path.write_text('{"format": 1, "registrations": {"not": "a list"}}')
    assert RegistrationFile(path).load(reg_mesh()) == []
    assert not path.exists() and (state / "registrations.json.bad").exists()
    assert "registrations.json.registrations: expected a list" in caplog.text, caplog.text


def test_saved_hosts_that_no_longer_fit_the_mesh_are_left_out(tmp_path, caplog) -> None:
    """A restart with a mesh file that lost a version: its hosts are not restored; the rest
    are, with their since and health, and held as lost until they register again."""
    mesh = reg_mesh(service={"versions": {"v1": {"endpoints": []}, "v2": {"endpoints": []}},
                             "route": {"weights": {"v1": 100, "v2": 0}}})  # fmt: skip
    state = tmp_path / "state"
    journal = RegistrationFile(state / "registrations.json")
    registry = Registry(journal=journal)
    for port, version, serving in ((9001, "v1", True), (9002, "v2", True), (9003, "v1", False)):
        reg = Register(f"n{port}", Endpoint("127.0.0.1", port), "llm", version, serving=serving)
        registry.add(reg, token=port, spiffe_id=None, mesh=mesh)
    registry.close()  # the last change written
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    saved = {e.reg.endpoint.port: e for e in journal.load(mesh)}
    assert set(saved) == {9001, 9002, 9003} and saved[9003].healthy is False

    restored = journal.load(reg_mesh())  # llm has v1 only now
    assert {e.reg.endpoint.port for e in restored} == {9001, 9003}
    assert "register.version: unknown version 'v2'" in caplog.text, caplog.text
    again = Registry()
    held = again.restore(restored, reg_mesh(grace="60s"), lambda: None)
    assert {e.reg.endpoint.port: e.since for e in held} == {p: saved[p].since for p in (9001, 9003)}
    rows = {r["address"]: r for r in again.to_json()}
    assert rows["127.0.0.1:9003"]["health"] == "NOT_SERVING"
    assert {r["stream"] for r in rows.values()} == {"lost"}
    again.close()

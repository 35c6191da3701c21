"""Sidecar supervision against real Envoy and the real control plane: restart after a crash,
and last-known-good config when Envoy restarts while the control plane is down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc

from mesh_common.ports import free_port
from mesh_common.process_group import stop_group
from meshlm.commands.sidecar import native_keys
from sidecar.bootstrap import ads_bootstrap
from sidecar.lkg import LastKnownGood
from sidecar.supervisor import Supervisor
from tests.test_xds_support import Caller, CallLoop, eventually, llm_mesh, upstreams
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh


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
    with upstreams("v1") as ups, build_server(llm_mesh(ups), debounce=0.02) as cp:
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
        cp = build_server(llm_mesh(ups, weights={"v1": 0, "v2": 100}), debounce=0.02).start()
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
            # Static listeners from the dump keep SO_REUSEPORT off (issue 9, defect 9).
            listeners = sv.envoy.bootstrap["static_resources"]["listeners"]
            assert [x["enable_reuse_port"] for x in listeners] == [False]
            # The accepted config, not a default: all traffic still goes to v2.
            assert [caller.who() for _ in range(10)] == ["v2"] * 10
            # The stored copy survives the supervisor too, in a file only its owner can read.
            assert LastKnownGood(tmp_path / "lkg.json").get("caller-sv") is not None
            assert (tmp_path / "lkg.json").stat().st_mode & 0o077 == 0

            lkg_pid = sv.envoy.proc.pid
            with CallLoop(port) as loop:
                cp = build_server(llm_mesh(ups, weights={"v1": 100, "v2": 0}), debounce=0.02)
                cp.start(grpc_port=cp_port)
                eventually(lambda: sv.mode == "ads" and sv.ready, what="back on ADS")
                assert eventually(lambda: caller.who() == "v1", what="follows the control plane")
                eventually(lambda: _gone(lkg_pid), what="the last-known-good Envoy has left")
            # Switching back to ADS dropped no call (issue 9, defect 11).
            assert loop.failures == [] and loop.total() > 0, loop.failures[:3]
            caller.close()
        finally:
            sv.stop()
            cp.stop()


# -- issue 9: supervision (defect 10), ports (defect 9), last-known-good (defect 11) ---------------


def _meshlm_sidecar(*args: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "meshlm.cli", "sidecar", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _envoy_children(pid: int) -> list[int]:
    kids = [
        k for t in Path(f"/proc/{pid}/task").iterdir() for k in (t / "children").read_text().split()
    ]
    return [int(k) for k in kids if "envoy" in Path(f"/proc/{k}/comm").read_text()]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_second_sidecar_on_the_same_ports_exits_with_address_in_use(tmp_path) -> None:
    with upstreams("v1") as ups, build_server(llm_mesh(ups), debounce=0.02) as cp:
        sv, port = _supervisor(cp.grpc_port, LastKnownGood())
        sv.start()
        try:
            sv.wait_ready()
            caller = Caller(port)
            assert eventually(lambda: caller.who() == "v1", what="routed via ADS")
            xds = f"127.0.0.1:{cp.grpc_port}"
            # The same listener port; then the same admin port too.
            for admin in ((), ("--admin-port", str(sv.admin_port))):
                second = subprocess.run(
                    [sys.executable, "-m", "meshlm.cli", "sidecar", "--xds", xds,
                     "--node-id", "caller-2", "--outbound-port", str(port), *admin],
                    capture_output=True, text=True, timeout=60,
                )  # fmt: skip
                out = second.stdout + second.stderr
                assert second.returncode == 1 and "address already in use" in out.lower(), out
            # The first sidecar keeps every connection: nothing was split off to the second.
            assert [caller.who() for _ in range(20)] == ["v1"] * 20
            caller.close()
        finally:
            sv.stop()


def test_killed_sidecar_takes_its_envoy_along_and_a_new_one_serves(tmp_path) -> None:
    with upstreams("v1") as ups, build_server(llm_mesh(ups), debounce=0.02) as cp:
        port, admin = free_port(), free_port()
        args = ("--xds", f"127.0.0.1:{cp.grpc_port}", "--node-id", "caller-k9",
                "--outbound-port", str(port), "--admin-port", str(admin))  # fmt: skip
        first = _meshlm_sidecar(*args, log=tmp_path / "first.log")
        second = None
        try:
            caller = Caller(port)
            assert eventually(lambda: caller.who() == "v1", 60, what="first sidecar routes")
            (envoy,) = _envoy_children(first.pid)
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            assert eventually(lambda: _gone(envoy), 10, what="its Envoy died with it")
            second = _meshlm_sidecar(*args, log=tmp_path / "second.log")
            assert eventually(lambda: caller.who() == "v1", 60, what="the new sidecar routes")
            (new_envoy,) = _envoy_children(second.pid)
            info = json.loads(
                urllib.request.urlopen(f"http://127.0.0.1:{admin}/server_info").read()
            )
            assert new_envoy != envoy and "cannot bind" not in (tmp_path / "second.log").read_text()
            assert info["state"] == "LIVE"
            caller.close()
        finally:
            for p in (first, second):
                if p is not None:
                    stop_group(p)


def test_sidecar_without_control_plane_says_it_waits_then_that_config_arrived() -> None:
    with upstreams("v1") as ups:
        cp_port = free_port()
        events: list[str] = []
        sv, port = _supervisor(cp_port, LastKnownGood())
        sv.on_event = events.append
        sv.start()
        try:
            eventually(lambda: any("waiting for the control plane" in e for e in events),
                       what=f"says it waits (events: {events})")  # fmt: skip
            assert not any("ready (ads)" in e for e in events), events
            cp = build_server(llm_mesh(ups), debounce=0.02).start(grpc_port=cp_port)
            try:
                caller = Caller(port)
                assert eventually(lambda: caller.who() == "v1", 30, what="routed once it answers")
                assert eventually(lambda: any("config from the control plane" in e for e in events))
                caller.close()
            finally:
                cp.stop()
        finally:
            sv.stop()


def test_envoy_temp_dirs_are_removed_on_crash_restart_and_on_stop() -> None:
    with upstreams("v1") as ups, build_server(llm_mesh(ups), debounce=0.02) as cp:
        sv, _port = _supervisor(cp.grpc_port, LastKnownGood())
        sv.start()
        try:
            sv.wait_ready()
            first = sv.envoy.log_path.parent
            assert first.is_dir()
            sv.envoy.kill()
            eventually(lambda: sv.restarts == 1 and sv.ready, what="restarted")
            second = sv.envoy.log_path.parent
            assert second != first and not first.exists()
        finally:
            sv.stop()
        assert not second.exists()


def test_sidecar_with_service_but_no_version_is_a_clear_error() -> None:
    for extra in ((), ("--mesh", "examples/mesh.yaml")):
        r = subprocess.run(
            [sys.executable, "-m", "meshlm.cli", "sidecar", "--xds", "127.0.0.1:1",
             "--service", "llm", "--outbound-port", str(free_port()), *extra],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert r.returncode == 2 and "--version" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_last_known_good_keeps_its_true_age_across_loads(tmp_path) -> None:
    path = tmp_path / "lkg.json"
    dump = _accepted_dump()
    assert LastKnownGood(path, ttl=0.5).put("n", dump)
    assert LastKnownGood(path, ttl=0.5).get("n") is not None
    time.sleep(0.7)
    # Reloading must not give the stale copy a fresh lifetime.
    assert LastKnownGood(path, ttl=0.5).get("n") is None
    assert LastKnownGood(path, ttl=60).get("n") is not None


def _accepted_dump() -> dict:
    listener = {"name": "l", "address": {"socket_address": {"address": "127.0.0.1",
                                                            "port_value": 1}}}  # fmt: skip
    lds = "type.googleapis.com/envoy.admin.v3.ListenersConfigDump"
    return {"configs": [{"@type": lds, "version_info": "1",
                         "dynamic_listeners": [{"name": "l", "active_state":
                                                {"listener": listener}}]}]}  # fmt: skip


GENERATE = "/meshlm.inference.v1.Inference/Generate"
TENANTS = {
    "acme": {"key_sha256": hash_key("demo-acme-key"), "allow": ["llm/*"]},
    "free": {"key_sha256": hash_key("demo-free-key"), "allow": ["llm/Generate"]},
}


def _call(ch: grpc.Channel, key: str | None) -> str:
    md = (("x-api-key", key),) if key else ()
    try:
        return ch.unary_unary(GENERATE)(b"", metadata=md, timeout=10).decode()
    except grpc.RpcError as e:
        return e.code().name


def test_native_authz_last_known_good_boot_allows_keys_and_denies_bad_ones(tmp_path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("acme: demo-acme-key\nfree: demo-free-key\n")
    keys.chmod(0o600)
    with upstreams("runtime") as ups:
        runtime = ups["runtime"].address
        raw = {
            "services": {"llm": {"versions": {"v1": {"endpoints": [runtime]}}}},
            "tenants": TENANTS,
            "authz": {"mode": "native", "keys_file": str(keys)},
        }
        cp = build_server(parse_mesh(raw), debounce=0.02).start()
        port = free_port()
        boot = ads_bootstrap("native-sv", xds_address=("127.0.0.1", cp.grpc_port),
                             service="llm", version="v1", inbound_port=port,
                             local_endpoint=runtime, admin_port=free_port())  # fmt: skip
        lkg = LastKnownGood(tmp_path / "lkg.json")
        sv = Supervisor("native-sv", boot, ("127.0.0.1", cp.grpc_port), lkg=lkg,
                        poll_interval=0.2, keys=native_keys(str(keys)))  # fmt: skip
        sv.start()
        try:
            sv.wait_ready()
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                assert eventually(lambda: _call(ch, "demo-acme-key") == "runtime")
            eventually(lambda: sv.saved_at is not None, what="last-known-good stored")
            cp.stop()
            sv.envoy.kill()
            eventually(lambda: sv.restarts == 1 and sv.ready, what="restarted")
            assert sv.mode == "lkg"
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                assert _call(ch, "demo-acme-key") == "runtime"
                assert _call(ch, "demo-free-key") == "runtime"
                for bad in (None, "not-a-key", "[redacted]"):
                    assert _call(ch, bad) == "UNAUTHENTICATED", bad
            # The keys were not copied into the cache file, nor left in Envoy's directory.
            assert "demo-acme-key" not in (tmp_path / "lkg.json").read_text()
            for f in sv.envoy.workdir.iterdir():
                assert "demo-acme-key" not in f.read_text(errors="replace"), f
        finally:
            sv.stop()
            cp.stop()

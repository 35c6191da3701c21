"""The faults set at run time (`meshlm fault add`) across a new mesh file and a restart. A new
file (`meshlm apply`) replaces the old file's faults, while a run-time fault stays in force
(still injected by the real caller Envoy) unless the new file takes its name or scope, or its
version is gone; each one dropped is logged with why. A restarted control plane restores a
host fault once its host is back."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import yaml

from tests.test_faults_envoy import MARK, TOKEN, _meshlm, _outcomes, _raw
from tests.test_xds_support import Caller, eventually, sidecar, upstreams
from xds_server.admin.api import AdminServer
from xds_server.admin.faults import FaultFile
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh


def test_a_new_mesh_file_keeps_the_run_time_faults_it_can_take(tmp_path: Path, caplog) -> None:
    with upstreams("v1", "v2") as ups:
        v1, v2 = ups["v1"].address, ups["v2"].address
        slow_v1 = {"service": "llm", "host": v1, "delay": {"fixed_delay": "1s"}}
        first = _raw(ups, {"v1": 100, "v2": 0}, faults={"from-file": slow_v1})
        cp = build_server(parse_mesh(first), debounce=0.02).start()
        admin = AdminServer(cp, token=TOKEN).start()
        envoy, port = sidecar(cp, "faults-apply")
        try:
            with envoy:
                caller = Caller(port)
                eventually(lambda: caller.who(), what="the outbound route")
                url = ("--admin", admin.url)
                add = ("fault", "add")
                r = _meshlm(*add, "marked", "--service", "llm", "--header", f"{MARK}=1",
                            "--abort-grpc", "14", *url)  # fmt: skip
                assert r.returncode == 0, r.stderr
                r = _meshlm(*add, "on-v2", "--service", "llm", "--host", v2, "--delay", "1s", *url)
                assert r.returncode == 0, r.stderr
                assert set(cp.mesh.faults) == {"from-file", "marked", "on-v2"}

                # v2 leaves; the new file has no faults of its own.
                second = _raw({"v1": ups["v1"]}, {"v1": 100})
                path = tmp_path / "mesh.yaml"
                path.write_text(yaml.safe_dump(second))
                with caplog.at_level(logging.WARNING, logger="xds_server.control_plane"):
                    r = _meshlm("apply", "--mesh", str(path), *url)
                assert r.returncode == 0, r.stderr
                assert set(cp.mesh.faults) == {"marked"}
                assert cp.mesh.faults["marked"].at_run_time
                assert "fault dropped: faults.on-v2.host" in caplog.text, caplog.text
                # Still injected: a marked call is aborted, an unmarked one served.
                assert set(_outcomes(caller, 3, ((MARK, "1"),))) == {"UNAVAILABLE"}
                assert set(_outcomes(caller, 3)) == {"v1"}
                assert "marked: llm" in _meshlm("fault", "list", *url).stdout

                # A file that names a fault the same says what it wants: the file's wins.
                third = _raw({"v1": ups["v1"]}, {"v1": 100}, faults={"marked": slow_v1})
                path.write_text(yaml.safe_dump(third))
                caplog.clear()
                with caplog.at_level(logging.WARNING, logger="xds_server.control_plane"):
                    assert _meshlm("apply", "--mesh", str(path), *url).returncode == 0
                assert "mesh file defines a fault of that name" in caplog.text
                kept = cp.mesh.faults["marked"]
                assert kept.host == v1 and not kept.at_run_time and kept.abort is None
                eventually(lambda: _outcomes(caller, 1, ((MARK, "1"),)) == {"v1": 1},
                           what="the file's fault in place of the run-time one")  # fmt: skip
                caller.close()
        finally:
            admin.stop()
            cp.stop()


def test_a_restored_host_fault_waits_for_its_host_to_come_back(tmp_path: Path) -> None:
    """A control plane restarted on its faults file restores a `host:` fault whose host is not
    an endpoint yet (a registered host that has not registered again) once the host is back,
    keeping it in the file meanwhile; one whose host never comes back is dropped after the
    patience."""
    with upstreams("v1") as ups:
        later = "127.0.0.1:7"
        doc = {"name": "slow-later", "service": "llm", "host": later,
               "delay": {"fixed_delay": "1s", "percent": 100.0}, "expires_at": None}  # fmt: skip
        file = tmp_path / "faults.json"
        file.write_text(json.dumps([doc]))
        cp = build_server(parse_mesh(_raw(ups, {"v1": 100})), debounce=0.02).start()
        admin = AdminServer(cp, token=TOKEN, faults_file=file).start()
        try:
            assert not cp.mesh.faults
            time.sleep(1.0)  # a few expiry ticks: the file still holds it
            assert [d["name"] for d in json.loads(file.read_text())] == ["slow-later"]
            assert cp.add_endpoint("llm", "v1", later, timeout=0) is not None
            eventually(lambda: "slow-later" in cp.mesh.faults, what="the restored fault")
            assert cp.mesh.faults["slow-later"].at_run_time
        finally:
            admin.stop()
            cp.stop()
        # Its host gone for good: dropped once the patience has passed.
        cp = build_server(parse_mesh(_raw(ups, {"v1": 100})), debounce=0.02).start()
        try:
            faults = FaultFile(file)
            assert faults.restore(cp, time.time(), patience=0.0) == []
            assert not faults.pending and not cp.mesh.faults
        finally:
            cp.stop()

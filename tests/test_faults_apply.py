"""A new mesh file (`meshlm apply`) and the faults set at run time (`meshlm fault add`): the
file's own faults are replaced by the new file's, while a run-time fault stays in force
(still injected by the real caller Envoy) unless the new file takes its name or scope, or its
version is gone; each one dropped is logged with why."""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from tests.test_faults_envoy import MARK, TOKEN, _meshlm, _outcomes, _raw
from tests.test_xds_support import Caller, eventually, sidecar, upstreams
from xds_server.admin.api import AdminServer
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

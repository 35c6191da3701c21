"""The scaler's `command` implementation with real commands, and the SLO loop inside a real
`meshlm xds-server` process: it scales out through the operator's command when TTFT breaches,
scales in when it holds, and `GET /slo` and `meshlm status` show what it did and why."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from mesh_common.ports import free_port
from tests.test_slo_envoy import Metrics
from tests.test_xds_support import eventually
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.slo.loop import Reading, SloController
from xds_server.slo.scaler import CommandScaler, ScalerError

PY = shlex.quote(sys.executable)


def py(code: str) -> str:
    return f"{PY} -c {shlex.quote(code)}"


def test_command_scaler_reads_the_endpoint_and_passes_the_replica_by_environment(
    tmp_path: Path,
) -> None:
    log = tmp_path / "in.json"
    out = py("import os; print('starting'); v = os.environ['MESHLM_VERSION']; "
             "print('127.0.0.1:' + v[1:] + '000')")  # fmt: skip
    keep = py("import os, json, sys; json.dump({k: v for k, v in os.environ.items() "
              f"if k.startswith('MESHLM_')}}, open({str(log)!r}, 'w'))")  # fmt: skip
    s = CommandScaler(out, keep)
    assert s.scale_out("llm", "v7") == "127.0.0.1:7000"
    s.scale_in("llm", "v7", "127.0.0.1:7000")
    assert json.loads(log.read_text()) == {
        "MESHLM_SERVICE": "llm", "MESHLM_VERSION": "v7", "MESHLM_ENDPOINT": "127.0.0.1:7000"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("import sys; sys.exit('no quota left')", "exited 1: no quota left"),
        ("print('localhost:80')", "is not an IPv4 address"),
        ("pass", "printed no endpoint"),
    ],
)
def test_command_scaler_failures_say_why(code: str, message: str) -> None:
    with pytest.raises(ScalerError, match=message):
        CommandScaler(py(code), "true").scale_out("llm", "v1")


def _get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_xds_server_scales_out_and_in_by_command_and_status_shows_why(tmp_path: Path) -> None:
    metrics = Metrics()
    metrics.ttft_ms = 2000.0
    replica = free_port()
    mesh = {
        "services": {
            "llm": {
                "versions": {
                    "v1": {
                        "endpoints": [f"127.0.0.1:{free_port()}"],
                        "metrics_urls": [f"http://127.0.0.1:{metrics.server_port}/metrics"],
                    }
                },
                "slo": {"ttft_p99": "1s", "interval": "200ms", "intervals": 2,
                        "recover_intervals": 2, "min_requests": 0, "actions": ["scale_out"]},
            }
        }
    }  # fmt: skip
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(mesh))
    stopped = tmp_path / "stopped"
    grpc_port, admin_port = free_port(), free_port()
    scale_in = py(f"import os; open({str(stopped)!r}, 'w').write(os.environ['MESHLM_ENDPOINT'])")
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshlm.cli", "xds-server", "--mesh", str(path),
         "--grpc-port", str(grpc_port), "--admin-port", str(admin_port), "--scaler", "command",
         "--scale-out-command", py(f"print('127.0.0.1:{replica}')"),
         "--scale-in-command", scale_in],
        env={**os.environ, "MESHLM_ADMIN_TOKEN": "test-slo-token"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        eventually(lambda: _get(admin + "/slo"), 30, "xds-server admin up")
        eventually(lambda: _get(admin + "/slo")["llm"]["replicas"], 20, "scaled out")
        status = subprocess.run(
            [sys.executable, "-m", "meshlm.cli", "status", "--admin", admin],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert "SLO  DEVIATION  IN FORCE" in status
        assert "apply scale_out: starting a replica of v1 (TTFT p99 2000ms" in status
        assert f"ready scale_out: replica 127.0.0.1:{replica} added to v1 (" in status
        metrics.ttft_ms = 300.0
        # the command creates the file before it writes the address: wait for the address
        eventually(lambda: stopped.exists() and stopped.read_text(), 20, "scaled in by the command")
        assert stopped.read_text() == f"127.0.0.1:{replica}"
        # The undo is recorded once the command has returned: a moment after the file exists.
        doc = eventually(lambda: (d := _get(admin + "/slo")["llm"])["history"][2:] and d, 10)
        assert doc["replicas"] == [] and doc["in_force"] == []
        assert [h["direction"] for h in doc["history"]] == ["apply", "ready", "undo"]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=15)
        metrics.shutdown()
    assert proc.returncode == 0, out


def test_the_loop_keeps_measuring_while_a_scale_out_command_runs(tmp_path: Path) -> None:
    """A replica can take minutes to load its model: neither `GET /slo` nor the next interval
    waits for it; the replica is added by EDS when the command prints its endpoint."""
    go = tmp_path / "go"
    out = py(f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
             "print('127.0.0.1:9')")  # fmt: skip
    slo = {"ttft_p99": "1s", "intervals": 1, "actions": ["scale_out"], "min_requests": 0}
    mesh = parse_mesh({"services": {"llm": {"versions": {"v1": {"endpoints": []}}, "slo": slo}}})
    with build_server(mesh, debounce=0.02) as cp:
        ttft = [5.0]
        loop = SloController(
            cp, "llm", scaler=CommandScaler(out, "true"), read=lambda: Reading(ttft_p99=ttft[0])
        )
        assert loop.tick()["deviation"] == 4.0  # returns with the command still running
        assert loop.status()["pending"]["version"] == "v1" and not go.exists()
        ttft[0] = 3.0
        assert loop.tick()["deviation"] == 2.0
        assert loop.status()["last"]["deviation"] == 2.0 and loop.status()["replicas"] == []
        go.touch()
        eventually(lambda: loop.status()["replicas"] == ["127.0.0.1:9"], 30, "added")
        assert [str(e) for e in cp.mesh.services["llm"].versions["v1"].endpoints] == ["127.0.0.1:9"]
        loop.close()

"""Logs (issue 16 item 4): `--log-level`/`--log-format` on every command; the control plane's
line per sidecar connect, push, ACK, NACK (with Envoy's error) and disconnect and its audit line
per admin change (who, what, result; never the token); a sidecar's start line naming its
listeners, admin URL and log file. Read from the real processes' output where they live in one."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mesh_common.ports import free_port
from meshlm import logs
from meshlm.cli import COMMANDS, command_parser
from tests.test_admin_token import Xds, env  # noqa: F401  (the fixture)
from tests.test_xds_support import (
    eventually,
    llm_mesh,
    sidecar,
    upstreams,
    with_unvalidated_endpoint,
)
from xds_server.admin.token import token_path
from xds_server.compose import build_server


def test_every_command_takes_log_level_and_log_format() -> None:
    for name in COMMANDS:
        args = command_parser(name)._option_string_actions
        assert {"--log-level", "--log-format"} <= set(args), name
    r = subprocess.run([sys.executable, "-m", "meshlm.cli", "status", "--log-format", "xml"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "--log-format" in r.stderr and "'json'" in r.stderr


def _events(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_xds_server_json_log_of_a_sidecar_and_admin_changes(tmp_path: Path, env: dict) -> None:  # noqa: F811
    with upstreams("v1", "v2") as ups:
        mesh = {"services": {"llm": {
            "versions": {n: {"endpoints": [u.address]} for n, u in sorted(ups.items())},
            "route": {"weights": {"v1": 100, "v2": 0}}}}}  # fmt: skip
        (tmp_path / "mesh.yaml").write_text(yaml.safe_dump(mesh))
        grpc_port, admin_port = free_port(), free_port()
        xds = Xds(tmp_path, grpc_port, admin_port, "--log-format", "json", env=env)
        side_log = tmp_path / "sidecar.out"
        side = None
        try:
            xds.wait_up()
            with open(side_log, "w") as out:
                side = subprocess.Popen(
                    [sys.executable, "-m", "meshlm.cli", "sidecar", "--xds",
                     f"127.0.0.1:{grpc_port}", "--outbound-port", str(free_port()),
                     "--node-id", "logs-1"],
                    env=env, stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            start = eventually(
                lambda: [x for x in side_log.read_text().splitlines() if "listeners:" in x],
                60, "the sidecar's start line",
            )[0]  # fmt: skip
            assert start.startswith("sidecar logs-1: listeners: ")
            assert "admin http://127.0.0.1:" in start and "/envoy.log" in start
            assert "outbound" in start, start

            def meshlm(*argv: str, **extra: str) -> subprocess.CompletedProcess:
                return subprocess.run(
                    [sys.executable, "-m", "meshlm.cli", *argv],
                    env={**env, **extra}, capture_output=True, text=True, timeout=60,
                )  # fmt: skip

            admin = f"http://127.0.0.1:{admin_port}"
            ok = meshlm("weights", "llm", "v1=50", "v2=50", "--admin", admin)
            assert ok.returncode == 0, ok.stderr
            bad = meshlm("weights", "llm", "v1=0", "v2=100", "--admin", admin,
                         MESHLM_ADMIN_TOKEN="not-the-token-123")  # fmt: skip
            assert bad.returncode == 1
            token = (
                Path(env["XDG_RUNTIME_DIR"]) / "meshlm" / token_path(admin_port).name
            ).read_text()
        finally:
            if side is not None:
                side.terminate()
                side.wait(30)
        eventually(lambda: any(e.get("event") == "disconnect" for e in _events(xds.output())),
                   20, "the disconnect line")  # fmt: skip
        xds.stop()
    text = xds.output()
    events = _events(text)
    mine = [e for e in events if e.get("node") == "logs-1"]
    kinds = [e["event"] for e in mine]
    assert kinds[0] == "connect" and kinds[-1] == "disconnect", kinds
    assert mine[0]["api"] == "delta" and mine[0]["level"] == "info"
    for kind in ("push", "ack"):
        assert {e["type"] for e in mine if e["event"] == kind} >= {"CDS", "LDS", "RDS", "EDS"}
    audits = [e for e in events if e.get("event") == "admin"]
    assert [(a["what"], a["status"]) for a in audits] == [
        ("POST /v1/services/llm/weights", 200),
        ("POST /v1/services/llm/weights", 401),
    ]
    assert audits[0]["who"].startswith("token sha256:") and audits[1]["who"] == "bad token"
    assert audits[0]["peer"].startswith("127.0.0.1:") and "ok=True" in audits[0]["message"]
    assert token not in text and "not-the-token-123" not in text


def test_nack_line_carries_envoys_error() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    sync_log = logging.getLogger("xds_server.xds.sync")
    sync_log.addHandler(handler)
    level = sync_log.level
    sync_log.setLevel(logging.INFO)
    try:
        with upstreams("v1", "v2") as ups:
            cp = build_server(llm_mesh(ups), debounce=0.05).start()
            envoy, _ = sidecar(cp, "nack-1")
            try:
                with envoy:
                    eventually(
                        lambda: cp.syncz()["nodes"]["nack-1"]["types"]["EDS"]["acked_version"]
                    )
                    bad = with_unvalidated_endpoint(cp.mesh, "v1", "llm-host.invalid", 50051)
                    result = cp.update_mesh(bad, timeout=20)
                    assert not result.ok
            finally:
                cp.stop()
    finally:
        sync_log.removeHandler(handler)
        sync_log.setLevel(level)
    nacks = [e for e in _events(stream.getvalue()) if e["event"] == "nack"]
    assert nacks and all(e["node"] == "nack-1" and e["level"] == "warning" for e in nacks)
    eds = [e for e in nacks if e["type"] == "EDS"]
    assert eds[0]["version"] == result.version and "malformed IP address" in eds[0]["error"]
    assert "malformed IP address" in eds[0]["message"]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_log_level_warning_keeps_info_lines_out(fmt: str) -> None:
    code = (
        "import logging; from meshlm import logs; "
        f"logs.setup('warning', '{fmt}'); "
        "logging.getLogger('x').info('quiet'); logging.getLogger('x').warning('loud')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert "quiet" not in r.stderr and "loud" in r.stderr
    if fmt == "json":
        assert json.loads(r.stderr)["level"] == "warning"

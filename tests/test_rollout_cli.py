"""`meshlm rollout ...` over real HTTP. The admin server of the control plane is not built yet, so
`StandInAdminServer` mounts `RolloutAPI.handle` the way it will (bearer token on mutations);
the decisions run on the fakes of test_rollout_controller.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from meshlm.cli import main
from tests.test_rollout_controller import SPEC, FakeControlPlane, FakeGrpcCounts, FakeLatency
from xds_server.rollout.api import PREFIX, RolloutAPI, is_mutation
from xds_server.rollout.controller import RolloutController
from xds_server.rollout.gates.sources import Sources

TOKEN = "s3cret"


@pytest.fixture
def admin(tmp_path: Path) -> Iterator[tuple[str, FakeControlPlane]]:
    cp = FakeControlPlane()
    c = RolloutController(
        cp,
        str(tmp_path / "r.json"),
        lambda s: Sources(FakeGrpcCounts(), FakeLatency()),
        autorun=False,
    )
    api = RolloutAPI(c, lambda service: dict(SPEC) if service == "llm" else None)

    class StandInAdminServer(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            method, path = self.command, self.path
            if not path.startswith(PREFIX):
                code, reply = 404, {"error": "not found"}
            elif is_mutation(method, path) and self.headers.get("authorization") != (
                f"Bearer {TOKEN}"
            ):
                code, reply = 401, {"error": "missing or wrong bearer token"}
            else:
                n = int(self.headers.get("content-length") or 0)
                code, reply = api.handle(method, path, self.rfile.read(n))
            body = json.dumps(reply).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _serve

        def log_message(self, *a: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), StandInAdminServer)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", cp
    finally:
        srv.shutdown()
        srv.server_close()
        c.close()


def _token_file(tmp_path: Path) -> str:
    path = tmp_path / "admin.token"
    path.write_text(TOKEN + "\n")
    return str(path)


def test_cli_start_status_pause_abort_fake_metrics(admin, capsys, tmp_path) -> None:
    url, cp = admin
    a = ["--admin", url, "--token-file", _token_file(tmp_path)]
    assert main(["rollout", "start", "llm", *a, "--steps", "10,50"]) == 0
    out = capsys.readouterr().out
    assert "llm: Progressing" in out and "v2 10 %" in out
    assert main(["rollout", "status", "llm", "--admin", url, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["spec"]["steps"] == [10, 50, 100] and st["weights"] == {"v1": 90, "v2": 10}
    assert main(["rollout", "pause", "llm", *a]) == 0
    assert "Paused" in capsys.readouterr().out
    assert main(["rollout", "abort", "llm", *a]) == 0
    assert "RolledBack" in capsys.readouterr().out
    assert [w["v2"] for _, w in cp.calls] == [10, 0]


def test_cli_mutations_need_the_token_and_errors_are_clear_fake_metrics(
    admin, capsys, tmp_path
) -> None:
    url, cp = admin
    token = ["--token-file", _token_file(tmp_path)]
    assert main(["rollout", "start", "llm", "--admin", url]) == 1
    assert "HTTP 401" in capsys.readouterr().err
    assert cp.calls == []
    assert main(["rollout", "promote", "nope", "--admin", url, *token]) == 1
    assert "HTTP 404" in capsys.readouterr().err
    assert main(["rollout", "status", "--admin", url]) == 0
    assert "no rollouts" in capsys.readouterr().out
    assert main(["rollout", "pause", "--admin", url, *token]) == 2  # no SERVICE
    dead = "http://127.0.0.1:9"
    assert main(["rollout", "status", "llm", "--admin", dead, "--timeout", "2"]) == 1
    assert "cannot reach" in capsys.readouterr().err

"""meshlm's secrets (the admin token above all) stay with the process that holds them: a
scaler's command, a replica the LocalScaler starts, a process of the local mesh and an etcd
member get the environment less those names (mesh_common/child_env.py)."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import pytest

from mesh_common.child_env import SECRETS
from meshlm.demo.procs import Proc
from xds_server.slo.scaler import CommandScaler, LocalScaler

SECRET_ENV = {name: f"secret-{i}" for i, name in enumerate(sorted(SECRETS))}


@pytest.fixture
def secrets_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def test_command_scaler_commands_do_not_see_the_admin_token(secrets_set, tmp_path) -> None:
    seen = tmp_path / "env.json"
    dump = (f"import os, json; json.dump(dict(os.environ), open({str(seen)!r}, 'w')); "
            "print('127.0.0.1:9000')")  # fmt: skip
    cmd = f"{shlex.quote(sys.executable)} -c {shlex.quote(dump)}"
    assert CommandScaler(cmd, cmd, timeout=30).scale_out("llm", "v1") == "127.0.0.1:9000"
    env = json.loads(seen.read_text())
    assert env["MESHLM_SERVICE"] == "llm"  # what it needs still comes
    assert not SECRETS & set(env), sorted(SECRETS & set(env))


def test_local_scaler_children_do_not_see_the_admin_token(secrets_set, tmp_path) -> None:
    scaler = LocalScaler("127.0.0.1:1", workdir=str(tmp_path))
    # `xds-server --help` exits at once; its environment is read while it imports.
    proc = scaler._spawn("probe", ["xds-server", "--help"])
    try:
        env = _environ(proc.pid)
    finally:
        proc.kill()
        proc.wait(10)
    assert env, "the child exited before its environment was read"
    assert not SECRETS & set(env), sorted(SECRETS & set(env))


def test_local_mesh_processes_get_only_the_secrets_passed_to_them(secrets_set, tmp_path) -> None:
    code = "import os, json, time; print(json.dumps(dict(os.environ)), flush=True); time.sleep(30)"
    p = Proc("probe", [sys.executable, "-c", code], tmp_path, env={"MESHLM_ADMIN_TOKEN": "t"})
    p.start()
    try:
        end = time.monotonic() + 30
        while not p.log_path.read_text().strip() and time.monotonic() < end:
            time.sleep(0.05)
        env = json.loads(p.log_path.read_text())
    finally:
        p.stop(timeout=5)
    assert env["MESHLM_ADMIN_TOKEN"] == "t"  # passed explicitly: the control plane needs it
    assert not (SECRETS - {"MESHLM_ADMIN_TOKEN"}) & set(env)

"""`meshlm xds-server` and `meshlm sidecar` as a first user runs them by hand, as real processes:
a sidecar joins the mesh without the control plane logging a failed handshake, says what each of
its ports is for, a call made to its inbound port by mistake says so, and Ctrl-C stops each one
cleanly with a line saying so (the control plane with a sidecar still connected). Join tokens
go to the private run dir, not the folder the user is in."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from mesh_common.ports import free_port
from meshlm.demo.procs import Proc, wait_until
from tests.test_identity_support import short_dir


def _mesh(inbound: int) -> dict:
    return {
        "control_plane": {
            "grpc_port": free_port(),
            "admin_port": free_port(),
            "ca_port": free_port(),
            "ca_mtls_port": free_port(),
        },
        "identity": {"trust_domain": "meshlm.local", "cert_ttl": "15m"},
        "services": {
            "llm": {
                "service_account": "default/llm",
                "versions": {"v1": {"endpoints": [f"127.0.0.1:{inbound}"]}},
                "route": {"weights": {"v1": 100}},
            }
        },
    }


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop(timeout=10)


def _meshlm(argv: list[str], env: dict, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshlm.cli", *argv],
        cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _interrupt(p: Proc, timeout: float = 30) -> tuple[int, str]:
    assert p.popen is not None
    p.popen.send_signal(signal.SIGINT)
    code = p.popen.wait(timeout)
    return code, p.log_path.read_text()


def test_join_ports_and_ctrl_c_by_hand(tmp_path: Path, procs: list[Proc]) -> None:
    run = short_dir()  # the sidecar's SDS socket lives below it: a unix socket path holds 107 bytes
    env = {
        "XDG_RUNTIME_DIR": str(run),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "MESHLM_ADMIN_TOKEN": "",
    }
    inbound = free_port()
    mesh = _mesh(inbound)
    (tmp_path / "mesh.yaml").write_text(yaml.safe_dump(mesh))
    cp = Proc.meshlm(
        "xds", ["xds-server", "--mesh", str(tmp_path / "mesh.yaml")], tmp_path, env=env
    ).start()
    procs.append(cp)
    wait_until(lambda: "ADS over mTLS" in cp.tail(50), 60, "control plane up", cp)
    admin = f"https://127.0.0.1:{mesh['control_plane']['admin_port']}"
    token = tmp_path / "llm.token"
    # Join tokens stay out of the folder the user is in (a repository, say): without --out, or
    # with a bare name, they go to the private run dir, and the command says where.
    repo = tmp_path / "repo"
    repo.mkdir()
    tokens = run / "meshlm" / "join-tokens"
    for out, name in ((["--out", "llm.token"], "llm.token"), ([], "join-token-default-x.json")):
        sa = "default/llm" if out else "default/x"
        argv = ["identity", "token", "--service-account", sa, "--admin", admin, *out]
        r = _meshlm(argv, env, cwd=repo)
        assert r.returncode == 0, r.stderr
        assert f"written to {tokens / name} (mode 0600" in r.stdout, r.stdout
        assert (tokens / name).stat().st_mode & 0o777 == 0o600
    assert list(repo.iterdir()) == []
    # --out with a directory part is used as given.
    given = tmp_path / "given.token"
    argv = ["identity", "token", "--service-account", "default/x", "--admin", admin]
    r = _meshlm([*argv, "--out", str(given)], env)
    assert r.returncode == 0 and given.exists(), r.stderr
    token = "llm.token"  # a bare name: the sidecar finds it in the run dir
    grpc_port = mesh["control_plane"]["grpc_port"]
    argv = (
        f"sidecar --xds 127.0.0.1:{grpc_port} --service llm --version v1 --inbound-port "
        f"{inbound} --local-endpoint 127.0.0.1:{free_port()} --identity --join-token-file {token}"
    )
    sc = Proc.meshlm("sidecar", argv.split(), tmp_path, env=env).start()
    procs.append(sc)
    where = wait_until(
        lambda: next(ln for ln in sc.tail(50).splitlines() if "listeners:" in ln),
        90,
        "sidecar listeners",
        sc,
    )
    assert "mTLS from mesh workloads only" in where, where
    wait_until(lambda: "connect llm-v1" in cp.tail(80), 30, "ADS stream", cp)
    # A joining sidecar is no failed handshake on the control plane.
    assert "Handshake failed" not in cp.log_path.read_text()

    # Calling the inbound port directly: it takes only mTLS from mesh workloads.
    gen = Proc.meshlm(
        "generate",
        ["generate", "--target", f"127.0.0.1:{inbound}", "--timeout", "10", "hi"],
        tmp_path,
        env=env,
    ).start()
    assert gen.popen.wait(60) == 1
    assert "takes only mTLS from mesh workloads" in gen.log_path.read_text(), gen.tail()

    # Ctrl-C of the control plane with the sidecar connected: exit 0, "stopped", no traceback.
    code, out = _interrupt(cp)
    assert code == 0, out
    assert "xds-server: stopped" in out and "Traceback" not in out, out
    assert "Exception not handled" not in out, out

    # Ctrl-C of the sidecar: it says it drains, then that it stopped.
    code, out = _interrupt(sc)
    assert code == 0, out
    assert "draining" in out and out.rstrip().endswith(
        f"sidecar llm-v1-{os.uname()[1]}-{inbound}: stopped"
    ), out

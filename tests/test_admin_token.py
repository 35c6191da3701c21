"""The admin token of `meshlm xds-server` (issue 9, defects 3 and 9): a private directory, a file
written atomically and only after every port is bound, never a token on a command line, and a
second control plane on a used port refused instead of sharing it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from mesh_common.ports import free_port
from tests.test_xds_support import eventually

MESH = {
    "services": {
        "llm": {
            "versions": {"v1": {"endpoints": ["127.0.0.1:9"]}},
            "route": {"weights": {"v1": 100}},
        }
    }
}


class Xds:
    """`meshlm xds-server` as a process, its output in a file."""

    def __init__(self, tmp: Path, grpc_port: int, admin_port: int, *args: str, env: dict) -> None:
        mesh = tmp / "mesh.yaml"
        if not mesh.exists():
            mesh.write_text(yaml.safe_dump(MESH))
        self.log = tmp / f"xds-{time.monotonic_ns()}.log"
        self.admin = f"http://127.0.0.1:{admin_port}"
        argv = [sys.executable, "-m", "meshlm.cli", "xds-server", "--mesh", str(mesh),
                "--grpc-port", str(grpc_port), "--admin-port", str(admin_port), *args]  # fmt: skip
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()

    def wait_up(self) -> str:
        """The startup line, once the admin API answers."""
        up = lambda: self.proc.poll() is None and _line(self.output(), "admin on")  # noqa: E731
        try:
            return eventually(up, 30, "admin up")
        except AssertionError:
            raise AssertionError(f"xds-server not up:\n{self.output()}") from None

    def exit_code(self, timeout: float = 30) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def env(tmp_path: Path) -> dict:
    run = tmp_path / "xdg"
    run.mkdir(mode=0o700)
    clean = {k: v for k, v in os.environ.items() if k != "MESHLM_ADMIN_TOKEN"}
    return {**clean, "XDG_RUNTIME_DIR": str(run)}


@pytest.fixture
def started() -> Iterator[list[Xds]]:
    procs: list[Xds] = []
    yield procs
    for p in procs:
        p.stop()


def _line(out: str, marker: str) -> str:
    return next((line for line in out.splitlines() if marker in line), "")


def _token_path(startup: str) -> Path:
    m = re.search(r"written to (\S+)", startup)
    assert m, startup
    return Path(m.group(1))


def test_second_control_plane_on_used_ports_is_refused_and_token_untouched(
    tmp_path: Path, env: dict, started: list[Xds]
) -> None:
    grpc_port, admin_port = free_port(), free_port()
    first = Xds(tmp_path, grpc_port, admin_port, env=env)
    started.append(first)
    path = _token_path(first.wait_up())
    before = (path.read_bytes(), path.stat().st_ino)

    # Same ports (the mesh file's defaults for both): refused at the gRPC port, token kept.
    second = Xds(tmp_path, grpc_port, admin_port, env=env)
    started.append(second)
    assert second.exit_code() not in (0, None), second.output()
    out = second.output()
    assert f"gRPC port {grpc_port}: address already in use" in out, out
    assert "Traceback" not in out
    assert (path.read_bytes(), path.stat().st_ino) == before

    # Same ADS port only: before the fix this one ran and took half the sidecars.
    third = Xds(tmp_path, grpc_port, free_port(), env=env)
    started.append(third)
    assert third.exit_code() not in (0, None), third.output()
    assert "address already in use" in third.output() and "Traceback" not in third.output()

    # A used admin port fails after the gRPC bind: still no token written anywhere.
    files = sorted(p.name for p in path.parent.iterdir())
    fourth = Xds(tmp_path, free_port(), admin_port, env=env)
    started.append(fourth)
    assert fourth.exit_code() not in (0, None), fourth.output()
    assert f"admin port {admin_port}: address already in use" in fourth.output()
    assert sorted(p.name for p in path.parent.iterdir()) == files
    assert (path.read_bytes(), path.stat().st_ino) == before
    assert first.proc.poll() is None


def test_token_file_is_private_and_replaces_a_planted_symlink(
    tmp_path: Path, env: dict, started: list[Xds]
) -> None:
    grpc_port, admin_port = free_port(), free_port()
    first = Xds(tmp_path, grpc_port, admin_port, env=env)
    started.append(first)
    path = _token_path(first.wait_up())
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o777 == 0o600
    token = path.read_text().strip()
    assert len(token) >= 32 and token not in first.output()
    first.stop()

    # Another local user plants a symlink where the next token goes: it must not be followed.
    victim = tmp_path / "victim"
    victim.write_text("victim\n")
    path.unlink(missing_ok=True)
    path.symlink_to(victim)
    second = Xds(tmp_path, grpc_port, admin_port, env=env)
    started.append(second)
    assert _token_path(second.wait_up()) == path
    assert victim.read_text() == "victim\n"
    assert not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600
    assert len(path.read_text().strip()) >= 32


def test_a_run_dir_that_is_not_private_is_refused(
    tmp_path: Path, env: dict, started: list[Xds]
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (Path(env["XDG_RUNTIME_DIR"]) / "meshlm").symlink_to(elsewhere)
    xds = Xds(tmp_path, free_port(), free_port(), env=env)
    started.append(xds)
    assert xds.exit_code() not in (0, None), xds.output()
    assert "symlink" in xds.output() and "Traceback" not in xds.output()
    assert list(elsewhere.iterdir()) == []


def test_no_token_on_command_lines(tmp_path: Path, env: dict) -> None:
    for argv in (
        ["xds-server", "--mesh", "m.yaml", "--admin-token", "s3cret"],
        ["apply", "--mesh", "m.yaml", "--token", "s3cret"],
        ["rollout", "abort", "llm", "--token", "s3cret"],
    ):
        r = subprocess.run(
            [sys.executable, "-m", "meshlm.cli", *argv],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 2 and "unrecognized arguments" in r.stderr, (argv, r.stderr)


def test_clients_find_the_running_control_planes_token(
    tmp_path: Path, env: dict, started: list[Xds]
) -> None:
    xds = Xds(tmp_path, free_port(), free_port(), env=env)
    started.append(xds)
    xds.wait_up()

    def meshlm(*argv: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "meshlm.cli", *argv],
            env={**env, **extra}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    r = meshlm("apply", "--mesh", str(tmp_path / "mesh.yaml"), "--admin", xds.admin)
    assert r.returncode == 0 and "nothing changed" in r.stdout, r.stderr
    # No rollout to abort: 404 from an authorized request, not 401.
    r = meshlm("rollout", "abort", "llm", "--admin", xds.admin)
    assert "HTTP 404" in r.stderr, r.stderr
    # An explicit file wins; a wrong token is refused with a hint where it came from.
    wrong = tmp_path / "wrong.token"
    wrong.write_text("not-the-token\n")
    r = meshlm("apply", "--mesh", str(tmp_path / "mesh.yaml"), "--admin", xds.admin,
               "--token-file", str(wrong))  # fmt: skip
    assert r.returncode == 1 and "HTTP 401" in r.stderr, r.stderr
    assert str(wrong) in r.stderr


def test_token_from_a_file_or_the_environment(
    tmp_path: Path, env: dict, started: list[Xds]
) -> None:
    secret = tmp_path / "admin.token"
    secret.write_text("file-token-0123456789\n")
    xds = Xds(tmp_path, free_port(), free_port(), "--token-file", str(secret), env=env)
    started.append(xds)
    startup = xds.wait_up()
    assert f"token from {secret}" in startup and "file-token" not in xds.output()
    r = subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "apply", "--mesh", str(tmp_path / "mesh.yaml"),
         "--admin", xds.admin],
        env={**env, "MESHLM_ADMIN_TOKEN": "file-token-0123456789"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    bad = Xds(tmp_path, free_port(), free_port(), "--token-file", str(empty), env=env)
    started.append(bad)
    assert bad.exit_code() == 2 and "--token-file" in bad.output(), bad.output()

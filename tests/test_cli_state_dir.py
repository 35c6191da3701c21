"""Where `meshlm xds-server` keeps its state (the mesh CA's root, rollouts), as a real process:
outside the mesh file's folder by default (often a repository), in --state-dir when given, and,
for a mesh run with an earlier version, in the `.meshlm/` beside the mesh file it already holds,
with a line saying so. Each rollout read back at start gets a line: a restarted control plane
keeps the rollout's weights, not the file's."""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from mesh_common.ports import free_port
from meshlm.demo.procs import Proc, wait_until
from xds_server.mesh.rollout_spec import parse_rollout
from xds_server.rollout.controller import SUCCEEDED, Rollout
from xds_server.store.state_file import RolloutStore


def _mesh_file(folder: Path) -> Path:
    folder.mkdir()
    mesh = {
        "control_plane": {
            "grpc_port": free_port(),
            "admin_port": free_port(),
            "ca_port": free_port(),
            "ca_mtls_port": free_port(),
        },
        "identity": {"trust_domain": "meshlm.local"},
        "services": {
            "llm": {
                "versions": {
                    "v1": {"endpoints": ["127.0.0.1:9"]},
                    "v2": {"endpoints": ["127.0.0.1:10"]},
                },
                "route": {"weights": {"v1": 100, "v2": 0}},
            }
        },
    }
    path = folder / "mesh.yaml"
    path.write_text(yaml.safe_dump(mesh))
    return path


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    return {"XDG_RUNTIME_DIR": str(run), "XDG_STATE_HOME": str(tmp_path / "state"),
            "MESHLM_ADMIN_TOKEN": "", "MESHLM_STATE_DIR": ""}  # fmt: skip


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop(timeout=10)


def _run(mesh: Path, env: dict, procs: list[Proc], *extra: str) -> str:
    """The control plane's output from start to a clean Ctrl-C."""
    cp = Proc.meshlm(f"xds-{len(procs)}", ["xds-server", "--mesh", str(mesh), *extra],
                     mesh.parent.parent, env=env).start()  # fmt: skip
    procs.append(cp)
    wait_until(lambda: "state in" in cp.tail(50), 60, "control plane up", cp)
    assert cp.popen is not None
    cp.popen.send_signal(signal.SIGINT)
    assert cp.popen.wait(30) == 0, cp.tail(50)
    return cp.log_path.read_text()


def test_state_is_kept_outside_the_mesh_files_folder(tmp_path: Path, env, procs) -> None:
    mesh = _mesh_file(tmp_path / "repo")
    out = _run(mesh, env, procs)
    digest = hashlib.sha256(str(mesh.resolve()).encode()).hexdigest()[:12]
    state = tmp_path / "state" / "meshlm" / f"mesh-{digest}"
    assert f"xds-server: state in {state} (" in out, out
    assert (state / "identity").is_dir() and os.stat(state).st_mode & 0o777 == 0o700
    assert [p.name for p in mesh.parent.iterdir()] == ["mesh.yaml"]  # nothing for git status
    given = tmp_path / "given"
    out = _run(mesh, env, procs, "--state-dir", str(given))
    assert f"xds-server: state in {given} (--state-dir)" in out, out
    assert (given / "identity").is_dir()


def test_a_state_dir_beside_the_mesh_file_is_used_and_its_rollouts_named(
    tmp_path: Path, env, procs
) -> None:
    mesh = _mesh_file(tmp_path / "repo")
    legacy = mesh.parent / ".meshlm"
    legacy.mkdir()
    spec = parse_rollout("llm", {"stable": "v1", "canary": "v2"})
    done = Rollout(spec=spec, state=SUCCEEDED, step=3, canary_weight=100, stable="v2")
    RolloutStore(legacy / "rollouts.json").save({"llm": done.to_dict()})
    out = _run(mesh, env, procs)
    assert f"xds-server: state in {legacy} (found beside the mesh file" in out, out
    assert (
        f"xds-server: rollout llm restored from {legacy / 'rollouts.json'}: Succeeded, weights "
        "v1=0 v2=100; the mesh file says v1=100 v2=0" in out
    ), out
    assert (legacy / "identity").is_dir() and (legacy / "rollouts.json").exists()
    assert not (tmp_path / "state").exists()

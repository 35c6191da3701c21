"""Mistakes a new user makes get one clear line on stderr and a non-zero exit (2 for usage
errors), never a Python traceback (issue 9, defect 14). Each runs the real `meshlm` CLI."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from tests.test_xds_support import Caller, eventually, llm_mesh, sidecar, upstreams
from xds_server.compose import build_server


def meshlm(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshlm.cli", *argv],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def assert_clear(r: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)


def test_serve_on_a_used_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = meshlm("serve", "--port", str(port))
        assert_clear(
            r, 1, f"meshlm serve: cannot listen on 127.0.0.1:{port}: address already in use"
        )
        r = meshlm("serve", "--port", "0", "--metrics-port", str(port))
        assert_clear(r, 1, f"--metrics-port {port}: address already in use")


def test_serve_usage_errors() -> None:
    r = meshlm("serve", "--port", "0", "--log-level", "loud")
    assert_clear(r, 2, "--log-level", "loud")


def test_serve_a_file_that_is_not_a_model(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model\n")
    r = meshlm("serve", "--port", "0", "--model", str(notes))
    assert_clear(r, 1, f"cannot load the model from {notes}", "not a GGUF file")


def test_generate_with_a_negative_seed() -> None:
    r = meshlm("generate", "--target", "127.0.0.1:9", "--seed", "-5", "hi")
    assert_clear(r, 2, "seed", "-5")


def test_generate_with_an_authority_the_mesh_does_not_route() -> None:
    with upstreams("v1") as ups:
        cp = build_server(llm_mesh(ups), debounce=0.01).start()
        try:
            envoy, port = sidecar(cp, "caller-cli")
            with envoy:
                eventually(lambda: Caller(port).who() == "v1", 30, "route to llm")
                r = meshlm("generate", "--target", f"127.0.0.1:{port}", "--authority", "nope", "hi")
                assert_clear(r, 1, "UNIMPLEMENTED", "'nope'", "no route")
        finally:
            cp.stop()


def test_policy_compile_into_a_closed_pipe(tmp_path: Path) -> None:
    tenants = {f"t{i}": {"key_sha256": f"{i:064x}", "allow": ["llm/*"]} for i in range(2000)}
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text(yaml.safe_dump({"tenants": tenants}))
    p = subprocess.Popen(
        [sys.executable, "-m", "meshlm.cli", "policy", "compile", "--mesh", str(mesh)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stdout is not None
    assert os.read(p.stdout.fileno(), 10)  # `| head -c 10`
    p.stdout.close()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.strip() == "meshlm policy: output closed early (broken pipe)", err


def test_demo_with_a_missing_workdir(tmp_path: Path) -> None:
    r = meshlm("demo", "--workdir", str(tmp_path / "nope"))
    assert_clear(r, 2, f"--workdir {tmp_path / 'nope'}: no such directory")
    assert "processes" not in r.stdout  # refused before anything started


def test_policy_compile_refuses_a_duplicate_tenant(tmp_path: Path) -> None:
    # `policy compile` reads the mesh file as strictly as the control plane (issue 9, defect 13).
    tenant = {"key_sha256": "0" * 64, "allow": ["llm/*"]}
    line = f"  acme: {yaml.safe_dump(tenant, default_flow_style=True).strip()}\n"
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text("tenants:\n" + line + line)
    r = meshlm("policy", "compile", "--mesh", str(mesh), "--service", "llm")
    assert_clear(r, 2, "tenants.acme: duplicate key 'acme' at line 3 (first at line 2)")


def test_a_yaml_error_names_the_file_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "mesh.yaml"
    bad.write_text("services:\n  llm: {versions: [\n")
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    admin = f"http://127.0.0.1:{free.getsockname()[1]}"  # nothing answers: apply checks first
    try:
        for argv in (("apply", "--mesh", str(bad), "--admin", admin),
                     ("xds-server", "--mesh", str(bad)),
                     ("policy", "compile", "--mesh", str(bad))):  # fmt: skip
            r = meshlm(*argv)
            assert_clear(r, 2, str(bad), "not valid YAML", f'in "{bad}", line 3, column 1')
            assert "<byte string>" not in r.stderr and "<unicode string>" not in r.stderr
    finally:
        free.close()

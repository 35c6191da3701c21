"""The admin API over HTTPS (issue 14, item 2) on a real `meshlm xds-server`: a mesh with
`identity` serves its admin port with a certificate of the mesh CA (the control plane's SPIFFE
ID, DNS localhost, IP of the bind address), the CLI finds the root to trust in the run dir beside
the token, a wrong root or plain HTTP fails with a message saying what to do, and the token is
still required. A mesh without identity keeps plain HTTP."""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from mesh_common.ports import free_port
from meshlm.cli import main as meshlm
from tests.test_admin_token import MESH, Xds
from tests.test_xds_support import eventually
from xds_server.identity.ca import MeshCA, spki_sha256

CONTROL_PLANE_ID = "spiffe://meshlm.local/ns/meshlm-system/sa/control-plane"


@dataclass
class Running:
    xds: Xds
    port: int
    run: Path  # XDG_RUNTIME_DIR
    mesh: Path
    startup: str

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path:
        return self.run / "meshlm" / f"admin-{self.port}-ca.pem"


def _start(tmp: Path, mesh: dict) -> Running:
    run = tmp / "xdg"
    run.mkdir(mode=0o700)
    (tmp / "mesh.yaml").write_text(yaml.safe_dump(mesh))
    env = {k: v for k, v in os.environ.items() if k != "MESHLM_ADMIN_TOKEN"}
    port = free_port()
    xds = Xds(tmp, free_port(), port, env={**env, "XDG_RUNTIME_DIR": str(run)})
    try:
        startup = xds.wait_up()
    except BaseException:
        xds.stop()
        raise
    return Running(xds, port, run, tmp / "mesh.yaml", startup)


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    ports = {"ca_port": free_port(), "ca_mtls_port": free_port()}
    mesh = {**MESH, "identity": {"cert_ttl": "10m"}, "control_plane": ports}
    running = _start(tmp_path_factory.mktemp("admin-https"), mesh)
    yield running
    running.xds.stop()


@pytest.fixture
def cli_env(cp: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI in this process sees the control plane's run dir, and no token in the env."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(cp.run))
    monkeypatch.delenv("MESHLM_ADMIN_TOKEN", raising=False)


def _tls(cp: Running) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cp.ca_file))


def _call(
    cp: Running, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict, x509.Certificate]:
    conn = http.client.HTTPSConnection("127.0.0.1", cp.port, context=_tls(cp), timeout=10)
    body = b'{"v1": 100}' if method == "POST" else None
    try:
        conn.request(method, path, body=body, headers=headers or {})
        reply = conn.getresponse()
        doc = json.loads(reply.read())
        cert = x509.load_der_x509_certificate(conn.sock.getpeercert(binary_form=True))
        return reply.status, doc, cert
    finally:
        conn.close()


def test_the_cli_talks_https_with_the_token_and_root_it_finds_beside_it(
    cp: Running, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert f"admin on {cp.url} " in cp.startup and str(cp.ca_file) in cp.startup
    roots = x509.load_pem_x509_certificates(cp.ca_file.read_bytes())
    assert roots and all(r.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
                         for r in roots)  # fmt: skip
    assert cp.ca_file.stat().st_mode & 0o777 == 0o600  # in the 0700 run dir, beside the token

    # A mutation: needs the token (the run dir's) and the root (the run dir's), no flags for them.
    assert meshlm(["apply", "--mesh", str(cp.mesh), "--admin", cp.url]) == 0
    assert "nothing changed" in capsys.readouterr().out  # the file it runs on
    assert meshlm(["identity", "status", "--admin", cp.url]) == 0
    assert "trust domain meshlm.local" in capsys.readouterr().out
    assert meshlm(["status", "--admin", cp.url]) == 0
    assert "incarnation" in capsys.readouterr().out
    # By name: the certificate's DNS SAN.
    assert meshlm(["rollout", "status", "--admin", f"https://localhost:{cp.port}"]) == 0
    assert "no rollouts" in capsys.readouterr().out


def test_a_root_that_did_not_sign_the_admin_certificate_is_refused(
    cp: Running, cli_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other-root.pem"  # another mesh CA, same trust domain
    other.write_bytes(MeshCA("meshlm.local").bundle_pem())
    code = meshlm(["apply", "--mesh", str(cp.mesh), "--admin", cp.url, "--cacert", str(other)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"refusing {cp.url}: its certificate failed verification against the root(s) in " \
           f"{other}" in err and "the token was not sent" in err  # fmt: skip
    assert "Traceback" not in err


def test_plain_http_to_the_https_port_fails_with_what_to_do(
    cp: Running, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = f"http://127.0.0.1:{cp.port}"
    # meshlm refuses before sending the token: it knows the local port's CA.
    assert meshlm(["apply", "--mesh", str(cp.mesh), "--admin", plain]) == 2
    err = capsys.readouterr().err
    assert f"the control plane at {plain} serves HTTPS" in err
    assert f"use --admin {cp.url}" in err
    # Any other HTTP client (curl) gets a 400 saying the same, not a reset connection.
    conn = http.client.HTTPConnection("127.0.0.1", cp.port, timeout=10)
    try:
        conn.request("POST", "/v1/mesh", body=cp.mesh.read_bytes())
        reply = conn.getresponse()
        assert reply.status == 400
        error = json.loads(reply.read())["error"]
    finally:
        conn.close()
    assert error.startswith(f"plain HTTP to the HTTPS admin API: use {cp.url} ")
    assert f"admin-{cp.port}-ca.pem" in error and "--cacert" in error


def test_no_token_goes_over_plain_http_to_another_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "token"
    token.write_text("secret-admin-token\n")
    args = ["rollout", "status", "--admin", "http://192.0.2.1:18001", "--token-file", str(token)]
    args += ["--timeout", "5"]
    assert meshlm(args) == 2  # before any connection (192.0.2.1 is TEST-NET-1: none answers)
    err = capsys.readouterr().err
    assert "refusing to send the admin token over plain HTTP to 192.0.2.1: use an https://" in err
    assert "secret-admin-token" not in err


def test_the_token_is_still_required_over_https(cp: Running) -> None:
    weights = "/v1/services/llm/weights"
    status, doc, _ = _call(cp, "POST", weights)
    assert status == 401 and "Bearer" in doc["error"]
    status, _, _ = _call(cp, "POST", weights, {"Authorization": "Bearer not-the-token"})
    assert status == 401
    token = (cp.run / "meshlm" / f"admin-{cp.port}.token").read_text().strip()
    status, doc, _ = _call(cp, "POST", weights, {"Authorization": f"Bearer {token}"})
    assert status == 200, doc
    status, doc, _ = _call(cp, "GET", "/debug/syncz")
    assert status == 200 and "nodes" in doc


def test_a_request_trickled_over_tls_is_cut_at_the_request_deadline(cp: Running) -> None:
    # Each byte well inside the socket timeout; the whole request never inside the deadline (5 s).
    raw = socket.create_connection(("127.0.0.1", cp.port), timeout=10)
    with _tls(cp).wrap_socket(raw, server_hostname="127.0.0.1") as s:
        start, closed = time.monotonic(), False
        for b in b"GET /debug/syncz HTTP/1.1\r\nHost: 127.0.0.1\r\n"[:24]:
            try:
                s.sendall(bytes([b]))
            except OSError:
                closed = True
                break
            time.sleep(0.5)
            if select.select([s], [], [], 0)[0]:
                try:
                    closed = s.recv(1) == b""
                except OSError:
                    closed = True
                if closed:
                    break
        assert closed and time.monotonic() - start < 9
    status, doc, _ = _call(cp, "GET", "/debug/syncz")
    assert status == 200 and "nodes" in doc


def test_the_certificate_names_the_control_plane_and_its_address(cp: Running) -> None:
    _, _, cert = _call(cp, "GET", "/debug/syncz")
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [CONTROL_PLANE_ID]
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_a_root_rotation_reaches_the_published_root(
    cp: Running, cli_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    def published() -> set[str]:
        return {spki_sha256(c) for c in x509.load_pem_x509_certificates(cp.ca_file.read_bytes())}

    (old,) = published()
    assert meshlm(["identity", "rotate-root", "--admin", cp.url]) == 0, capsys.readouterr().err
    new = json.loads(capsys.readouterr().out)["root_sha256"]
    eventually(lambda: published() == {old, new}, 10, "both roots in the published CA file")
    assert meshlm(["status", "--admin", cp.url]) == 0  # the old root signs until activation


def test_a_mesh_without_identity_keeps_plain_http_and_drops_a_stale_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "xdg"
    port = free_port()
    # Left by a control plane with identity on this port that did not stop cleanly.
    stale = run / "meshlm" / f"admin-{port}-ca.pem"
    stale.parent.mkdir(mode=0o700, parents=True)
    run.chmod(0o700)
    stale.write_bytes(MeshCA("meshlm.local").bundle_pem())
    (tmp_path / "mesh.yaml").write_text(yaml.safe_dump(MESH))
    env = {k: v for k, v in os.environ.items() if k != "MESHLM_ADMIN_TOKEN"}
    xds = Xds(tmp_path, free_port(), port, env={**env, "XDG_RUNTIME_DIR": str(run)})
    try:
        assert re.search(rf"admin on http://127\.0\.0\.1:{port} \(token written to \S+ "
                         r"\(mode 0600\)\)", xds.wait_up())  # fmt: skip
        assert not stale.exists()
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
        assert meshlm(["status", "--admin", f"http://127.0.0.1:{port}"]) == 0
        assert "incarnation" in capsys.readouterr().out
    finally:
        xds.stop()

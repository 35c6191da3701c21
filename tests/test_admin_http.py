"""The admin HTTP server of `meshlm xds-server` against a hostile local client (issue 9, defect
8): no body read before the token, bodies bounded, slow and idle connections bounded, deep JSON
and YAML refused, DNS rebinding refused by the Host check, `keys_file` fixed at start."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from mesh_common.ports import free_port
from tests.test_xds_support import eventually

TOKEN = "admin-http-test-token"
LLM = {"versions": {"v1": {"endpoints": ["127.0.0.1:9"]}}, "route": {"weights": {"v1": 100}}}
MESH = {"services": {"llm": LLM}}


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    mesh = tmp_path_factory.mktemp("admin-http") / "mesh.yaml"
    mesh.write_text(yaml.safe_dump(MESH))
    admin_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshlm.cli", "xds-server", "--mesh", str(mesh),
         "--grpc-port", "0", "--admin-port", str(admin_port)],
        env={**os.environ, "MESHLM_ADMIN_TOKEN": TOKEN},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        eventually(lambda: _call(admin_port, "GET", "/debug/syncz")[0] == 200, 30, "admin up")
        yield admin_port
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=15)
        assert proc.returncode == 0 and "Traceback" not in out, out


def _call(
    port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None
) -> tuple[int, dict]:
    head = {"Host": f"127.0.0.1:{port}", "Content-Length": str(len(body)), **(headers or {})}
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items() if v is not None)
    return _raw(port, f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode() + body)


def _raw(port: int, data: bytes, timeout: float = 5.0) -> tuple[int, dict]:
    """Send `data`, read one response (status, JSON body); the socket times out in `timeout`."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return _response(s)


def _response(s: socket.socket) -> tuple[int, dict]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, f"connection closed without a response: {buf!r}"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    fields = dict(h.lower().split(b":", 1) for h in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(body) < length:
        body += s.recv(65536)
    return int(head.split(b" ")[1]), json.loads(body)


def _auth() -> dict:
    return {"Authorization": f"Bearer {TOKEN}"}


def test_no_body_is_read_before_the_token_and_bodies_are_bounded(port: int) -> None:
    # 300 MB announced and never sent: before the fix the server sat reading it (and three
    # such posts that did send it took the control plane to 951 MB).
    huge = {"Content-Length": "300000000"}
    status, reply = _call(port, "POST", "/v1/mesh", headers=huge)
    assert status == 401 and "Bearer" in reply["error"]
    status, reply = _call(port, "POST", "/v1/mesh", headers={**huge, **_auth()})
    assert status == 413 and "limit" in reply["error"]
    chunked = {"Transfer-Encoding": "chunked", "Content-Length": None, **_auth()}
    status, reply = _call(port, "POST", "/v1/mesh", b"5\r\nhello\r\n0\r\n\r\n", chunked)
    assert status == 411 and "Content-Length" in reply["error"]


def test_deep_json_and_yaml_get_400_naming_the_problem(port: int) -> None:
    deep = b"[" * 50_000
    for path in ("/v1/services/llm/weights", "/rollouts/llm", "/v1/mesh"):
        status, reply = _call(port, "POST", path, deep, _auth())
        assert status == 400 and "nested too deeply" in reply["error"], (path, reply)
    block = "".join(f"{' ' * i}k{i}:\n" for i in range(1500)).encode()
    status, reply = _call(port, "POST", "/v1/mesh", block, _auth())
    assert status == 400 and "nested too deeply" in reply["error"], reply


def test_host_must_be_loopback_with_the_admin_port(port: int) -> None:
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port + 1}", None):
        status, reply = _call(port, "GET", "/debug/syncz", headers={"Host": host})
        assert status == 403 and "Host" in reply["error"], (host, reply)
    weights = json.dumps({"v1": 100}).encode()
    rebound = {"Host": f"rebind.example:{port}", **_auth()}
    assert _call(port, "POST", "/v1/services/llm/weights", weights, rebound)[0] == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert _call(port, "GET", "/debug/syncz", headers={"Host": host})[0] == 200, host


def test_slow_and_idle_connections_are_bounded(port: int) -> None:
    drip = socket.create_connection(("127.0.0.1", port), timeout=5)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(40)]
    try:
        # Over the bound (32, the dripping one included): 503 at once, no thread held.
        busy, deadline = set(), time.monotonic() + 3
        while len(busy) < 9 and time.monotonic() < deadline:
            for s in select.select(idle, [], [], 0.2)[0]:
                if s not in busy and s.recv(100).startswith(b"HTTP/1.1 503"):
                    busy.add(s)
        assert len(busy) == 9
        # A request sent a byte at a time is cut at the request deadline (5 s), though each
        # byte arrives well inside the socket timeout.
        start, closed = time.monotonic(), False
        for b in b"GET /debug/syncz HTTP/1.1\r\n"[:20]:
            try:
                drip.sendall(bytes([b]))
            except OSError:
                closed = True
                break
            time.sleep(0.5)
            if select.select([drip], [], [], 0)[0] and drip.recv(1) == b"":
                closed = True
                break
        assert closed and time.monotonic() - start < 8
    finally:
        for s in [drip, *idle]:
            s.close()
    assert eventually(lambda: _call(port, "GET", "/debug/syncz")[0] == 200, 10, "admin free")


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_a_body_on_head_is_refused_not_read_as_the_next_request(port: int) -> None:
    # The body of a HEAD is a whole GET: answered, it would be a request no Host or token check
    # saw as sent (request smuggling on a keep-alive connection).
    inner = f"GET /debug/syncz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    head = f"HEAD /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    head += f"Content-Length: {len(inner)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head.encode() + inner)
        replies = _read_all(s)
    assert replies.count(b"HTTP/1.1 ") == 1, replies
    assert replies.startswith(b"HTTP/1.1 400 "), replies


def test_no_100_continue_before_the_token_is_checked(port: int) -> None:
    # `Expect: 100-continue` must not invite a body that the token check then refuses.
    head = f"POST /v1/mesh HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 100000\r\n"
    head += "Expect: 100-continue\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head.encode())
        first = s.recv(65536).split(b"\r\n", 1)[0]
    assert first.startswith(b"HTTP/1.1 401 "), first


def test_a_posted_mesh_cannot_point_keys_file_anywhere(port: int, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("password: hunter2: x\n")  # not YAML: the parser's error quotes the line
    tenants = {"acme": {"key_sha256": "0" * 64, "allow": ["llm/*"]}}
    mesh = {**MESH, "tenants": tenants, "authz": {"mode": "native", "keys_file": str(secret)}}
    status, reply = _call(port, "POST", "/v1/mesh", yaml.safe_dump(mesh).encode(), _auth())
    assert status == 400 and reply["error"].startswith("authz.keys_file: "), reply
    assert "hunter2" not in json.dumps(reply)


def test_a_keys_file_that_is_not_yaml_is_named_not_quoted(tmp_path: Path) -> None:
    from xds_server.mesh import parse_mesh
    from xds_server.resources.build import build_resources
    from xds_server.xds.node import NodeInfo

    secret = tmp_path / "keys.yaml"
    secret.write_text("acme: [hunter2\n")
    tenants = {"acme": {"key_sha256": "0" * 64, "allow": ["llm/*"]}}
    mesh = parse_mesh(
        {**MESH, "tenants": tenants, "authz": {"mode": "native", "keys_file": str(secret)}}
    )
    node = NodeInfo(
        service="llm", version="v1", inbound_port=free_port(), local_endpoint="127.0.0.1:9"
    )
    with pytest.raises(ValueError, match=r"authz\.keys_file: .*keys\.yaml.* not YAML") as e:
        build_resources(mesh, node)
    assert "hunter2" not in str(e.value)

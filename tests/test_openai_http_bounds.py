"""The runtime's OpenAI HTTP server against hostile clients, directly (no sidecar): request
framing (a body on every method is read or refused), malformed bodies, slow bodies, many file
descriptors, chunked uploads. A real runtime (int4 SmolLM2) behind `OpenAIServer`; through the
mesh: tests/test_openai_mesh_bounds.py."""

from __future__ import annotations

import contextlib
import http.client
import json
import resource
import socket
import time
from collections.abc import Iterator

import pytest

from mesh_common.headers import TENANT_HEADER
from model_runtime.serving.openai_http import OpenAIServer
from model_runtime.serving.service import Runtime
from tests.runtime_fixtures import serving_runtime

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def runtime(smollm_int4) -> Iterator[Runtime]:
    rt = serving_runtime(smollm_int4)
    try:
        yield rt
    finally:
        rt.shutdown(grace=5)


@pytest.fixture(scope="module")
def server(runtime) -> Iterator[OpenAIServer]:
    # Few slots, a short whole-request deadline: what the slow-body test needs.
    srv = OpenAIServer(runtime, max_connections=8, request_timeout=3.0)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def model(runtime) -> str:
    return runtime.service.model_info.name


def _generates(runtime: Runtime) -> int:
    return sum(runtime.telemetry.snapshot()["totals"].get("Generate", {}).values())


def _chat_body(model: str, **kw) -> bytes:
    return json.dumps({"model": model, "messages": QUESTION, "temperature": 0} | kw).encode()


def _post(port: int, body: bytes, headers: dict | None = None, path="/v1/chat/completions"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body, {"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _read_all(s: socket.socket, deadline_s: float = 30) -> bytes:
    s.settimeout(deadline_s)
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_a_get_with_a_body_is_refused_and_its_body_never_runs(server, runtime, model) -> None:
    """A GET whose body is a whole second request: refused, the connection closed, and the body
    is never read as a request of its own (with a forged tenant header)."""
    smuggled = _chat_body(model, max_tokens=2)
    inner = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"%s: forged\r\nx-meshlm-priority: high\r\ncontent-length: %d\r\n\r\n%s"
        % (TENANT_HEADER.encode(), len(smuggled), smuggled)
    )
    before = _generates(runtime)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(
            b"GET /v1/models HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
            % (len(inner), inner)
        )
        s.shutdown(socket.SHUT_WR)
        reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]
    assert reply.count(b"HTTP/1.1 ") == 1  # one answer: the body was no request
    time.sleep(1)
    assert _generates(runtime) == before
    assert "forged" not in runtime.engine.stats()["tenants"]


@pytest.mark.parametrize(
    ("field", "extra"),
    [
        ("max_tokens", {"max_tokens": -1}),
        ("top_k", {"top_k": -1}),
        ("max_completion_tokens", {"max_completion_tokens": -5}),
        ("max_tokens", {"max_tokens": 1 << 40}),
        ("top_p", {"top_p": 1e308}),  # past a float32
    ],
)
def test_a_value_out_of_range_is_a_400_naming_its_field(server, model, field, extra):
    status, reply = _post(server.port, _chat_body(model, **extra))
    assert status == 400, reply
    assert reply["error"]["param"] == field and reply["error"]["message"].startswith(field)


def test_json_nested_too_deeply_is_a_400(server) -> None:
    status, reply = _post(server.port, b"[" * 100_000)
    assert status == 400 and "nested too deeply" in reply["error"]["message"]
    status, reply = _post(server.port, b'{"model": ' + b"[" * 100_000)
    assert status == 400


def test_slow_bodies_from_one_peer_leave_the_others_served(server, model) -> None:
    """40 requests whose body trickles (one byte of 50) from one peer (127.0.0.2): that peer
    gets at most its share of the connections, each until the whole-request deadline; another
    peer's call is answered meanwhile."""
    slow: list[socket.socket] = []
    try:
        for _ in range(40):
            s = socket.socket()
            s.settimeout(30)
            s.bind(("127.0.0.2", 0))
            s.connect(("127.0.0.1", server.port))
            with contextlib.suppress(OSError):  # a refused one may be closed already
                s.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 50\r\n\r\n{"
                )
            slow.append(s)
        time.sleep(0.5)
        status, reply = _post(server.port, _chat_body(model, max_tokens=20))
        assert status == 200, reply
        assert reply["choices"][0]["message"]["content"] == ANSWER
        # Each slow request ends: 503 at once (over its peer's share; or a reset, as the server
        # closes with the request unread) or 408 at the deadline.
        started = time.monotonic()
        answers = [_read_all(s).split(b"\r\n", 1)[0] for s in slow]
        assert set(answers) <= {
            b"HTTP/1.1 503 Service Unavailable",
            b"HTTP/1.1 408 Request Timeout",
            b"",
        }
        assert b"HTTP/1.1 408 Request Timeout" in answers
        assert time.monotonic() - started < 25  # the deadline (3 s), not the idle timeout
    finally:
        for s in slow:
            s.close()


def test_headers_that_trickle_are_cut_at_the_deadline(server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        started = time.monotonic()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
        with contextlib.suppress(OSError):
            for _ in range(20):
                time.sleep(0.5)
                s.sendall(b"x-pad: 1\r\n")
        _read_all(s)
        assert time.monotonic() - started < 25


def test_descriptors_above_1024_are_served(server, model) -> None:
    """With over 1,100 descriptors open in the process, the server's socket is above select()'s
    FD_SETSIZE: a call without stream is still answered."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1400:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    held = [socket.socket() for _ in range(1100)]
    try:
        assert max(s.fileno() for s in held) >= 1024
        status, reply = _post(server.port, _chat_body(model, max_tokens=20))
        assert status == 200, reply
        assert reply["choices"][0]["message"]["content"] == ANSWER
    finally:
        for s in held:
            s.close()


def _chunked(body: bytes, size: int = 7) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return (
        b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\nx-trailer: 1\r\n\r\n"
    )


def test_a_chunked_upload_is_served(server, model) -> None:
    body = _chunked(_chat_body(model, max_tokens=20))
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        for _ in range(2):  # keep-alive: the chunked body was read exactly
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"transfer-encoding: chunked\r\n\r\n" + body
            )
            r = http.client.HTTPResponse(s)
            r.begin()
            reply = json.loads(r.read())
            assert r.status == 200, reply
            assert reply["choices"][0]["message"]["content"] == ANSWER


@pytest.mark.parametrize(
    ("head", "body", "status"),
    [
        (b"transfer-encoding: chunked\r\n", b"%x\r\n" % (5 << 20), 413),
        (b"transfer-encoding: chunked\r\n", b"zz\r\n", 400),
        (b"transfer-encoding: chunked\r\ncontent-length: 5\r\n", b"0\r\n\r\n", 400),
        (b"transfer-encoding: gzip, chunked\r\n", b"0\r\n\r\n", 501),
        (b"content-length: 1\r\ncontent-length: 2\r\n", b"{}", 400),
        (b"content-length: +5\r\n", b"{}", 400),
    ],
)
def test_bad_framing_is_refused_and_the_connection_closed(server, head, body, status) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + head + b"\r\n" + body)
        reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 %d " % status), reply[:200]
    assert b"connection: close" in reply.lower()

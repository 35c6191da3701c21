"""Hostile calls to the control plane's admin API (real HTTP on loopback): random methods,
paths, headers and bodies get a 4xx with a JSON error, never a 5xx, and nothing changes without
the bearer token."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_xds_support import upstreams
from xds_server.admin.api import AdminServer
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.rollout.api import RolloutAPI, spec_from_mesh
from xds_server.rollout.controller import RolloutController
from xds_server.rollout.sources import configured_sources
from xds_server.server import XdsServer

TOKEN = "fuzz-admin-token-0123456789"
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def admin(tmp_path_factory) -> Iterator[tuple[AdminServer, XdsServer, RolloutController]]:
    with upstreams("v1", "v2") as ups:
        mesh = parse_mesh(
            {
                "services": {
                    "llm": {
                        "versions": {n: {"endpoints": [u.address]} for n, u in ups.items()},
                        "route": {"weights": {"v1": 100}},
                    }
                },
                "rollouts": {"llm": {"stable": "v1", "canary": "v2", "steps": [50, 100]}},
            }
        )
        cp = build_server(mesh, debounce=0.01).start()
        store = tmp_path_factory.mktemp("admin") / "rollouts.json"
        rollouts = RolloutController(cp, str(store), configured_sources(cp))
        api = RolloutAPI(rollouts, lambda s: spec_from_mesh(cp.mesh, s))
        server = AdminServer(cp, token=TOKEN, mounts={"/rollouts": api.handle}).start()
        try:
            yield server, cp, rollouts
        finally:
            server.stop()
            rollouts.close()
            cp.stop()


def _state(cp: XdsServer, rollouts: RolloutController) -> tuple:
    return cp.cache.generation, json.dumps(rollouts.status(), sort_keys=True, default=str)


def _request(port: int, method: str, path: str, body: bytes, headers: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


SEGMENTS = st.one_of(
    st.sampled_from(["v1", "services", "llm", "weights", "versions", "v2", "endpoints",
                     "debug", "syncz", "config_dump", "metrics", "rollouts", "pause", "resume",
                     "abort", "promote", "..", "%00", "%2e%2e", "?timeout=-1", "?timeout=nan", ""]),
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="/?#"),
            max_size=8),
)  # fmt: skip
PATHS = st.lists(SEGMENTS, max_size=6).map(lambda s: "/" + "/".join(s))
METHODS = st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS", "FOO"])
BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"{}", b"[]", b"null", b'{"v1": 50, "v2": 50}', b'{"add": "1.2.3.4:5"}',
                     b'{"remove": "x"}', b'{"v1": 1e309}', b'{"steps": "x"}', b'"\\ud800"',
                     b"{" * 2000]),
    st.recursive(st.one_of(st.none(), st.integers(), st.text(max_size=8), st.floats()),
                 lambda k: st.one_of(st.lists(k, max_size=3),
                                     st.dictionaries(st.text(max_size=5), k, max_size=3)),
                 max_leaves=8).map(lambda d: json.dumps(d).encode()),
)  # fmt: skip


@FUZZ
@given(METHODS, PATHS, BODIES)
def test_without_token_nothing_changes_and_no_5xx(admin, method, path, body) -> None:
    server, cp, rollouts = admin
    before = _state(cp, rollouts)
    status, data = _request(server.port, method, path, body, {"Authorization": "Bearer nope"})
    assert status < 500, (method, path, status, data)
    if method != "HEAD" and not data.startswith(b"# HELP"):  # GET /metrics: Prometheus text
        assert isinstance(json.loads(data), dict)
    if status >= 400 and method != "HEAD":
        assert "error" in json.loads(data)
    assert _state(cp, rollouts) == before, (method, path)


@FUZZ
@given(st.sampled_from(["POST", "DELETE", "PUT", "PATCH"]), PATHS, BODIES)
def test_with_token_bad_input_is_a_4xx_json_error(admin, method, path, body) -> None:
    server, _cp, rollouts = admin
    status, data = _request(server.port, method, path, body, {"Authorization": f"Bearer {TOKEN}"})
    assert status < 500, (method, path, status, data)
    reply = json.loads(data)
    if status >= 400:
        assert isinstance(reply, dict) and reply.get("error"), reply
    if 200 <= status < 300 and path.rstrip("/") == "/rollouts/llm" and method == "POST":
        with contextlib.suppress(Exception):  # a real rollout started: stop it again
            rollouts.abort("llm")


@pytest.mark.parametrize(
    "raw",
    [
        b"POST /v1/services/llm/weights HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/services/llm/weights HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"GET /debug/syncz HTTP/1.1\r\nHost: x\r\n" + b"X-A: " + b"a" * 70000 + b"\r\n\r\n",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # a TLS ClientHello
        b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
    ],
)
def test_malformed_http_gets_a_4xx_and_the_server_lives(admin, raw: bytes) -> None:
    server, cp, rollouts = admin
    before = _state(cp, rollouts)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    if reply.startswith(b"HTTP/"):
        assert 400 <= int(reply.split(b" ", 2)[1]) < 500, reply[:200]
    else:  # not HTTP/1.x at all: http.server answers the HTTP/0.9 way, a bare body
        assert json.loads(reply)["error"], reply[:200]
    assert _request(server.port, "GET", "/debug/syncz", b"", {})[0] == 200
    assert _state(cp, rollouts) == before

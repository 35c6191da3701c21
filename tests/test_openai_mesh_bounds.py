"""The OpenAI HTTP path through a real mesh against hostile clients: client -> caller sidecar ->
inbound sidecar (Wasm authz, buffer, request timeouts) -> a real runtime (int4 SmolLM2,
`OpenAIServer` with few connections). A body smuggled into a GET, slow bodies, and a streamed
upload without content-length (h2, chunked). The runtime's own server:
tests/test_openai_http_bounds.py."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from mesh_common.headers import TENANT_HEADER
from mesh_common.ports import free_port
from model_runtime.serving.openai_http import OpenAIServer
from model_runtime.serving.service import Runtime
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.runtime_fixtures import serving_runtime
from tests.test_xds_support import eventually
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
ANSWER = "The capital of France is Paris."
KEYS = {"acme": "acme-bounds-key", "info": "info-only-key", "slow": "slow-tenant-key"}


@dataclass
class Mesh:
    rt: Runtime
    inbound: EnvoyProcess
    caller: EnvoyProcess
    outbound_port: int

    def request(self, raw: bytes, timeout: float = 60) -> bytes:
        """`raw` to the caller sidecar; every byte of the answer until the connection ends."""
        with socket.create_connection(("127.0.0.1", self.outbound_port), timeout=timeout) as s:
            s.sendall(raw)
            out = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := s.recv(65536):
                    out += chunk
            return out


def _head(method: str, path: str, key: str, length: int, extra: bytes = b"") -> bytes:
    return (
        b"%s %s HTTP/1.1\r\nhost: llm\r\nauthorization: Bearer %s\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n%s\r\n"
        % (method.encode(), path.encode(), key.encode(), length, extra)
    )


@pytest.fixture(scope="module")
def mesh(smollm_int4) -> Iterator[Mesh]:
    rt = serving_runtime(smollm_int4)
    http = OpenAIServer(rt, max_connections=8)  # 4 for the sidecar, its one peer
    port, outbound = free_port(), free_port()
    doc = {
        "services": {"llm": {"versions": {"v1": {"endpoints": [f"127.0.0.1:{port}"]}}}},
        "tenants": {
            "acme": {"key_sha256": hash_key(KEYS["acme"]), "allow": ["llm/*"]},
            "info": {"key_sha256": hash_key(KEYS["info"]), "allow": ["llm/Info"]},
            "slow": {"key_sha256": hash_key(KEYS["slow"]), "allow": ["llm/*"]},
        },
    }
    cp = build_server(parse_mesh(doc), debounce=0.02).start()
    xds = ("127.0.0.1", cp.grpc_port)
    envoys: list[EnvoyProcess] = []
    try:
        boot = ads_bootstrap(
            "runtime-v1",
            xds_address=xds,
            service="llm",
            version="v1",
            inbound_port=port,
            local_endpoint=rt.target,
            local_http_endpoint=f"127.0.0.1:{http.port}",
        )
        envoys.append(EnvoyProcess(boot).start())
        envoys.append(
            EnvoyProcess(ads_bootstrap("caller", xds_address=xds, outbound_port=outbound)).start()
        )
        m = Mesh(rt, envoys[0], envoys[1], outbound)
        models = _head("GET", "/v1/models", KEYS["acme"], 0)
        eventually(lambda: m.request(models).startswith(b"HTTP/1.1 200"), what="/v1/models")
        yield m
    finally:
        for e in envoys:
            e.stop()
        cp.stop()
        http.stop()
        rt.shutdown(grace=0)


def _generates(rt: Runtime) -> int:
    return sum(rt.telemetry.snapshot()["totals"].get("Generate", {}).values())


def _chat(mesh: Mesh, key: str = KEYS["acme"]) -> tuple[int, dict]:
    body = json.dumps(
        {"model": mesh.rt.service.model_info.name, "messages": QUESTION, "max_tokens": 20}
        | {"temperature": 0}
    ).encode()
    reply = mesh.request(_head("POST", "/v1/chat/completions", key, len(body)) + body)
    head, _, payload = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload or b"{}")


def test_a_request_smuggled_in_a_get_body_never_runs(mesh: Mesh) -> None:
    """A tenant allowed only Info sends GET /v1/models whose body is a whole POST with a forged
    tenant and priority: the runtime runs no Generate for it."""
    model = mesh.rt.service.model_info.name
    inner_body = json.dumps({"model": model, "prompt": "Paris is", "max_tokens": 2}).encode()
    inner = (
        b"POST /v1/completions HTTP/1.1\r\nhost: llm\r\ncontent-type: application/json\r\n"
        b"%s: forged\r\nx-meshlm-priority: high\r\ncontent-length: %d\r\n\r\n%s"
        % (TENANT_HEADER.encode(), len(inner_body), inner_body)
    )
    before = _generates(mesh.rt)
    # Its own POST is denied: Info only.
    denied = mesh.request(_head("POST", "/v1/completions", KEYS["info"], 2) + b"{}")
    assert denied.startswith(b"HTTP/1.1 403"), denied[:200]
    for _ in range(3):  # on the sidecar's pooled connections to the runtime
        reply = mesh.request(_head("GET", "/v1/models", KEYS["info"], len(inner)) + inner)
        assert not reply.startswith(b"HTTP/1.1 200"), reply[:300]
        # Another call after it finds the pooled connection clean.
        status, answer = _chat(mesh)
        assert status == 200, answer
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        assert _generates(mesh.rt) == before + 3  # the three acme calls, nothing else
        time.sleep(0.25)
    assert "forged" not in mesh.rt.engine.stats()["tenants"]


def test_slow_bodies_hold_no_runtime_connection(mesh: Mesh) -> None:
    """40 requests of one tenant whose body trickles (one byte of 50): the sidecars hold them
    (the caller's class filter reads an OpenAI body whole for its prefix key before it sends
    it on), not the runtime (8 connections), and another tenant's call is answered meanwhile."""
    slow: list[socket.socket] = []
    stat = "http.outbound.downstream_rq_total"
    before = mesh.caller.stats(stat).get(stat, 0)
    try:
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", mesh.outbound_port), timeout=30)
            s.sendall(_head("POST", "/v1/chat/completions", KEYS["slow"], 50) + b"{")
            slow.append(s)
        eventually(
            lambda: mesh.caller.stats(stat).get(stat, 0) >= before + 40,
            what="the 40 slow requests at the caller sidecar",
        )
        time.sleep(0.5)
        status, answer = _chat(mesh)
        assert status == 200, answer
        assert answer["choices"][0]["message"]["content"] == ANSWER
    finally:
        for s in slow:
            s.close()


def test_a_streamed_upload_without_content_length_is_served(mesh: Mesh) -> None:
    """HTTP/2 without content-length (curl -T -) and HTTP/1.1 chunked, through the mesh."""
    model = mesh.rt.service.model_info.name
    body = json.dumps(
        {"model": model, "messages": QUESTION, "max_tokens": 20, "temperature": 0}
    ).encode()
    url = f"http://127.0.0.1:{mesh.outbound_port}/v1/chat/completions"
    headers = (
        "Host: llm",
        f"Authorization: Bearer {KEYS['acme']}",
        "content-type: application/json",
    )
    out = subprocess.run(
        [
            "curl",
            "-sS",
            "--http2-prior-knowledge",
            "-X",
            "POST",
            "-T",
            "-",
            url,
            "-w",
            "\n%{http_code}",
        ]
        + [arg for h in headers for arg in ("-H", h)],
        input=body,
        capture_output=True,
        timeout=120,
        check=True,
    )
    payload, _, code = out.stdout.rpartition(b"\n")
    assert code == b"200", out.stdout
    assert json.loads(payload)["choices"][0]["message"]["content"] == ANSWER
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    reply = mesh.request(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: llm\r\nauthorization: Bearer %s\r\n"
        b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n%s"
        % (KEYS["acme"].encode(), chunked)
    )
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), reply[:300]
    assert json.loads(payload)["choices"][0]["message"]["content"] == ANSWER

"""The Wasm authz filter in real Envoy under hostile headers (gRPC over HTTP/2 and raw HTTP/1.1):
names, values, sizes, encodings, duplicates and spoofed identity. Never a crash (Envoy stays
LIVE), never an allow without the valid key. tests/test_authz_host.py fuzzes the same filter
in the Python host; tests/test_authz_envoy.py covers stripping of client identity headers."""

from __future__ import annotations

import contextlib
import socket
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_xds_support import upstreams
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh

KEY = "fuzz-valid-key-9f3a"
GENERATE = "/meshlm.inference.v1.Inference/Generate"
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def inbound() -> Iterator[tuple[int, EnvoyProcess]]:
    with upstreams("runtime") as ups:
        runtime = ups["runtime"].address
        mesh = parse_mesh(
            {
                "services": {"llm": {"versions": {"v1": {"endpoints": [runtime]}}}},
                "tenants": {"acme": {"key_sha256": hash_key(KEY), "allow": ["llm/Generate"],
                                     "rate_limit": {"max_tokens": 100000,
                                                    "tokens_per_fill": 100000,
                                                    "fill_interval": "1s"}}},
            }
        )  # fmt: skip
        cp = build_server(mesh, debounce=0.01).start()
        port = free_port()
        b = ads_bootstrap("fuzz-inbound", xds_address=("127.0.0.1", cp.grpc_port),
                          service="llm", version="v1", inbound_port=port,
                          local_endpoint=runtime)  # fmt: skip
        try:
            with EnvoyProcess(b) as envoy:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                    assert _call(ch, [("x-api-key", KEY)]) == "runtime"
                yield port, envoy
        finally:
            cp.stop()


def _call(ch: grpc.Channel, md: list[tuple[str, str | bytes]], path: str = GENERATE) -> str:
    try:
        return ch.unary_unary(path)(b"", metadata=md, timeout=10).decode()
    except grpc.RpcError as e:
        return e.code().name


NAME = st.from_regex(r"\A[a-z0-9][a-z0-9._-]{0,40}\Z").filter(
    lambda n: not n.startswith("grpc-") and n not in ("te", "content-type", "user-agent")
)
PRINTABLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300)
KEY_LIKE = st.one_of(
    PRINTABLE,
    st.sampled_from([KEY.upper(), KEY + " ", " " + KEY, KEY[:-1], KEY + "x", KEY * 2,
                     KEY + "," + KEY, f"Bearer {KEY}", hash_key(KEY), "", "acme", "*"]),
    st.integers(0, 8000).map(lambda n: "k" * n),
)  # fmt: skip
EXTRA = st.lists(
    st.one_of(
        st.tuples(NAME, PRINTABLE),
        st.tuples(NAME.map(lambda n: n + "-bin"), st.binary(max_size=200)),
        st.tuples(st.sampled_from(["x-meshlm-tenant", "x-meshlm-priority", "x-api-key-bin",
                                   "x-forwarded-for", "authorization"]),
                  st.sampled_from(["acme", "high", "127.0.0.1", f"Bearer {KEY}"])),
    ),
    max_size=8,
)  # fmt: skip


@FUZZ
@given(st.lists(KEY_LIKE, max_size=3), EXTRA)
def test_grpc_headers_never_allow_without_the_valid_key(inbound, keys, extra) -> None:
    port, _envoy = inbound
    extra = [(n, v.encode() if n.endswith("-bin") and isinstance(v, str) else v) for n, v in extra]
    md = [("x-api-key", k) for k in keys] + extra
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        got = _call(ch, md)
    if got == "runtime":
        # HTTP drops whitespace around a field value (RFC 9110 5.5): " key " is the key.
        # With several x-api-key headers Envoy hands the filter one of them; allowed only if
        # the client did present the valid key.
        # `authorization: Bearer <key>` is the filter's documented alternative to x-api-key.
        bearer = [v[7:] for n, v in extra if n == "authorization" and isinstance(v, str)]
        assert KEY in [k.strip(" \t") for k in keys + bearer], (keys, extra)
    else:
        assert got in ("UNAUTHENTICATED", "PERMISSION_DENIED", "INTERNAL", "UNKNOWN",
                       "RESOURCE_EXHAUSTED", "UNAVAILABLE"), got  # fmt: skip
        if keys == [KEY]:  # the valid key alone, plus noise: a denial must be the headers' fault
            assert got != "UNAUTHENTICATED" or any(n == "x-api-key-bin" for n, _ in extra)


RAW_VALUES = st.one_of(
    st.binary(min_size=0, max_size=100).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
    st.sampled_from([KEY.encode() + b"\x00", "ключ".encode(), b"\xff\xfe" + KEY.encode(),
                     KEY.encode().replace(b"-", b"\xe2\x80\x90"), b"%66uzz", b"\t" + KEY.encode()]),
)  # fmt: skip


@settings(FUZZ, max_examples=25)
@given(RAW_VALUES, st.booleans())
def test_raw_http1_header_bytes_never_allow(inbound, value: bytes, grpc_ct: bool) -> None:
    port, _envoy = inbound
    ct = b"application/grpc" if grpc_ct else b"text/plain"
    head = b"POST " + GENERATE.encode() + b" HTTP/1.1\r\nHost: llm\r\nContent-Type: " + ct
    req = head + b"\r\nx-api-key: " + value + b"\r\nContent-Length: 0\r\n\r\n"
    reply = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(req)
        while b"\r\n\r\n" not in reply and (chunk := s.recv(65536)):
            reply += chunk
        s.settimeout(0.3)  # the body (if any) follows at once; do not wait for a close
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                reply += chunk
    assert reply.startswith(b"HTTP/1.1 "), reply[:100]
    assert b"runtime" not in reply, (value, reply[:300])


def test_duplicate_keys_first_value_decides(inbound) -> None:
    port, _ = inbound
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        first_valid = _call(ch, [("x-api-key", KEY), ("x-api-key", "wrong")])
        first_wrong = _call(ch, [("x-api-key", "wrong"), ("x-api-key", KEY)])
    assert first_wrong == "UNAUTHENTICATED"
    assert first_valid in ("runtime", "UNAUTHENTICATED")


def test_envoy_survived_the_fuzz(inbound) -> None:
    port, envoy = inbound
    with urllib.request.urlopen(f"{envoy.admin_url}/ready", timeout=5) as r:
        assert r.read().strip() == b"LIVE"
    assert envoy.proc.poll() is None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        assert _call(ch, [("x-api-key", KEY)]) == "runtime"
        assert _call(ch, []) == "UNAUTHENTICATED"

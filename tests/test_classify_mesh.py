"""The class filter where the control plane puts it: every caller sidecar's outbound listener.

client -> caller Envoy (outbound: class filter, from LDS) -> runtime-side Envoy (authz) -> echo.
"""

from __future__ import annotations

import json

import grpc

from schemas.codec import GenerateRequest, encode_generate_request
from tests.test_classify_envoy import class_by_host
from tests.test_mesh_support import ACME_KEY, GEN, two_hops


def call(port: int, message: bytes, md: list[tuple[str, str]]) -> dict[str, str]:
    opts = [("grpc.default_authority", "llm")]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
        return json.loads(ch.unary_unary(GEN)(message, metadata=md, timeout=10))


def test_caller_sidecars_classify_generate_calls_and_drop_spoofed_classes() -> None:
    question = encode_generate_request(GenerateRequest(prompt="What is the capital of Peru?"))
    key = [("x-api-key", ACME_KEY), ("x-meshlm-class", "0000000000000000")]
    with two_hops() as m:
        got = call(m.outbound_port, question, key)
        assert got["x-meshlm-class"] == class_by_host(question)
        assert got["x-meshlm-tenant"] == "acme"  # authz downstream unchanged
        garbage = call(m.outbound_port, b"\x01\x02\x03", key)
        assert "x-meshlm-class" not in garbage
        dump = m.caller.admin_get("/config_dump")
        assert "envoy.filters.http.wasm" in dump and "Peru" not in dump

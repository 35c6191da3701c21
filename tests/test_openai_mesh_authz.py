"""The authz filter for the OpenAI HTTP API (issue 17, item 2), in the wasmtime host: a Bearer
key, OpenAI paths checked as the gRPC method they run, denials in OpenAI's error JSON. The same
filter in real Envoys with the `openai` SDK: tests/test_openai_mesh.py."""

from __future__ import annotations

import json

import pytest

from wasm_filters.host import WasmHost
from wasm_filters.policy import (
    OPENAI_PATHS,
    CallerRule,
    compile_filter_config,
    hash_key,
    parse_policy,
)

CHAT = "/v1/chat/completions"
TENANTS = {
    "acme": {"key_sha256": hash_key("acme-key"), "allow": ["llm/*"]},
    "gen": {"key_sha256": hash_key("gen-key"), "allow": ["llm/Generate"]},
    "info": {
        "key_sha256": hash_key("info-key"),
        "allow": ["llm/Info"],
        "rate_limit": {"max_tokens": 1, "tokens_per_fill": 1, "fill_interval": "10s"},
    },
}
SPIFFE = "spiffe://meshlm.local/ns/default/sa/"


@pytest.fixture
def host() -> WasmHost:
    h = WasmHost()
    assert h.configure(compile_filter_config(parse_policy(TENANTS), service="llm"))
    return h


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def openai_error(d) -> dict:
    assert not d.allowed and d.grpc_status is None
    assert d.response_headers.get("content-type") == "application/json"
    return json.loads(d.body)["error"]


@pytest.mark.parametrize(
    ("key", "path", "allowed"),
    [
        ("gen-key", CHAT, True),
        ("gen-key", "/v1/completions?x=1", True),
        ("gen-key", "/v1/models", False),  # Info, not Generate
        ("info-key", "/v1/models", True),
        ("info-key", "/v1/models/smollm2", True),
        ("info-key", CHAT, False),
        ("acme-key", "/v1/models/a/b", False),  # one segment after /v1/models/ only
        ("acme-key", "/v1/embeddings", False),  # no method runs it: no rule reaches it
        ("acme-key", "/v1/chat/completions/x", False),
    ],
)
def test_openai_paths_count_as_the_method_they_run(host, key, path, allowed) -> None:
    d = host.request(bearer(key), path=path, grpc=False)
    assert d.allowed is allowed, (key, path, d.status, d.body)
    if not allowed:
        assert d.status == 403


def test_a_bearer_key_passes_and_no_credential_reaches_the_runtime(host) -> None:
    d = host.request({**bearer("gen-key"), "x-api-key": "gen-key"}, path=CHAT, grpc=False)
    assert d.allowed and d.header("x-meshlm-tenant") == b"gen"
    names = [k for k, _ in d.request_headers]
    assert b"authorization" not in names and b"x-api-key" not in names


def test_http_denials_are_openai_error_json(host) -> None:
    e = openai_error(missing := host.request({}, path=CHAT, grpc=False))
    assert missing.status == 401 and e["code"] == "missing_api_key"
    e = openai_error(bad := host.request(bearer("nope"), path=CHAT, grpc=False))
    assert bad.status == 401 and e == {
        "message": "unknown api key",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    e = openai_error(no := host.request(bearer("gen-key"), path="/v1/models", grpc=False))
    assert no.status == 403 and e["type"] == "permission_error"
    assert host.request(bearer("info-key"), path="/v1/models", grpc=False).allowed
    limited = host.request(bearer("info-key"), path="/v1/models", grpc=False)
    e = openai_error(limited)
    assert limited.status == 429 and e["code"] == "rate_limit_exceeded"
    assert limited.response_headers["retry-after"] == "10"


def test_grpc_denials_stay_grpc(host) -> None:
    d = host.request(bearer("nope"))
    assert d.status == 401 and d.grpc_status == 16 and d.body == b"unknown api key"
    assert "content-type" not in d.response_headers


def test_callers_rules_cover_the_openai_paths() -> None:
    """A workload allowed Generate may post chat completions, not list models (issue 14 rules
    are gRPC paths; the filter checks an OpenAI path as the method it runs)."""
    h = WasmHost()
    rules = [("default/app", SPIFFE + "app", ("/meshlm.inference.v1.Inference/Generate",))]
    cfg = compile_filter_config(
        parse_policy(TENANTS),
        service="llm",
        peer_identity=True,
        callers=[CallerRule(*r) for r in rules],
    )
    assert h.configure(cfg)
    who = SPIFFE + "app"
    assert h.request(bearer("acme-key"), path=CHAT, grpc=False, principal=who).allowed
    d = h.request(bearer("acme-key"), path="/v1/models", grpc=False, principal=who)
    assert d.status == 403 and openai_error(d)["code"] == "method_not_allowed"
    d = h.request(bearer("acme-key"), path=CHAT, grpc=False, principal=SPIFFE + "other")
    assert d.status == 403 and openai_error(d)["code"] == "unknown_caller"


def test_a_filter_config_with_a_bad_http_path_is_refused() -> None:
    h = WasmHost()
    doc = json.loads(compile_filter_config(parse_policy(TENANTS), service="llm"))
    assert {(p["path"], p["method"]) for p in doc["http_paths"]} == set(OPENAI_PATHS)
    doc["http_paths"] = [{"path": "v1/x", "method": "Generate"}]
    assert not h.configure(json.dumps(doc))

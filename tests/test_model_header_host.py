"""classify.wasm on the wasmtime proxy-wasm host: the `x-meshlm-model` header a Generate call
(GenerateRequest.model) or an OpenAI body (`"model"`) gets, and what never gets one."""

from __future__ import annotations

import json
import random

import pytest

from schemas.codec import GenerateRequest, encode_generate_request
from wasm_filters.host import CLASSIFY_WASM_PATH, WasmHost

GEN = "/meshlm.inference.v1.Inference/Generate"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi!"}]


def frame(msg: bytes, *, compressed: bool = False) -> bytes:
    return bytes([int(compressed)]) + len(msg).to_bytes(4, "big") + msg


def grpc_body(**kw: object) -> bytes:
    return frame(encode_generate_request(GenerateRequest(**kw)))  # type: ignore[arg-type]


@pytest.fixture
def host() -> WasmHost:
    h = WasmHost(CLASSIFY_WASM_PATH)
    assert h.configure(b"")
    return h


def model(
    host: WasmHost, body: bytes | list[bytes] | None, path: str = GEN, **hs: str
) -> str | None:
    d = host.request(
        {":authority": "127.0.0.1:15001", **hs}, path=path, grpc=path == GEN, body=body
    )
    assert d.allowed  # the filter only labels
    names = [v for k, v in d.request_headers if k == b"x-meshlm-model"]
    assert len(names) <= 1
    return names[0].decode() if names else None


def counts(host: WasmHost) -> dict[str, int]:
    return {k.rsplit(".", 1)[1]: v for k, v in host.metrics.items() if ".model_" in k}


def test_a_generate_calls_model_is_its_header(host: WasmHost) -> None:
    assert model(host, grpc_body(prompt="Hi", model="smollm2-int4")) == "smollm2-int4"
    assert model(host, grpc_body(messages=[], prompt="x", model="Org/Name:q4_1")) == "Org/Name:q4_1"
    assert model(host, grpc_body(prompt="Hi")) is None  # no model named: nothing to route on
    assert counts(host) == {"model_named": 2, "model_absent": 1, "model_malformed": 0}


def test_an_openai_bodys_model_is_its_header(host: WasmHost) -> None:
    chat = json.dumps({"model": "smollm2-bf16", "messages": HI}).encode()
    assert model(host, chat, CHAT) == "smollm2-bf16"
    done = json.dumps({"prompt": "Once", "model": "SmolLM2-BF16", "max_tokens": 2}).encode()
    assert model(host, done, COMPLETIONS) == "SmolLM2-BF16"  # as sent: routes ignore case
    # JSON escapes are read as JSON: \u002d is '-'
    assert model(host, b'{"model": "a\\u002db", "prompt": "x"}', COMPLETIONS) == "a-b"
    # in pieces, as Envoy delivers a body
    assert model(host, [chat[:7], chat[7:20], chat[20:]], CHAT) == "smollm2-bf16"
    # a nested "model" is not the request's
    nested = json.dumps({"messages": [{"role": "user", "content": "x", "model": "m"}]}).encode()
    assert model(host, nested, CHAT) is None


@pytest.mark.parametrize(
    "value",
    ["has space", "a\nb", "ünïcode", "m" * 129, "x;y", "a,b", "(a|b)"],
)
def test_a_name_outside_the_model_id_shape_is_never_a_header(host: WasmHost, value: str) -> None:
    assert model(host, json.dumps({"model": value, "messages": HI}).encode(), CHAT) is None
    assert model(host, grpc_body(prompt="Hi", model=value)) is None
    assert counts(host)["model_malformed"] == 2
    assert model(host, json.dumps({"model": "m" * 128, "messages": HI}).encode(), CHAT) == "m" * 128


@pytest.mark.parametrize("value", [7, None, ["a"], {"a": 1}, True])
def test_a_model_that_is_not_a_string_is_never_a_header(host: WasmHost, value: object) -> None:
    assert model(host, json.dumps({"model": value, "messages": HI}).encode(), CHAT) is None


def test_a_client_sent_model_header_is_removed_and_the_body_wins(host: WasmHost) -> None:
    spoof = {"x-meshlm-model": "other-model"}
    assert model(host, grpc_body(prompt="Hi", model="mine"), **spoof) == "mine"
    assert (
        model(host, json.dumps({"model": "mine", "messages": HI}).encode(), CHAT, **spoof) == "mine"
    )
    assert model(host, grpc_body(prompt="Hi"), **spoof) is None
    assert model(host, b"{not json", CHAT, **spoof) is None
    assert model(host, None, GEN, **spoof) is None  # headers only
    assert model(host, b"{}", "/v1/models", **spoof) is None  # a path the filter does not read


def test_bodies_it_cannot_read_pass_without_a_model(host: WasmHost) -> None:
    msg = encode_generate_request(GenerateRequest(prompt="Hi", model="mine"))
    assert model(host, frame(msg, compressed=True)) is None
    assert model(host, frame(msg)[:-3]) is None  # the stream ended inside its frame
    assert model(host, b'["model", "mine"]', CHAT) is None
    assert model(host, b'{"model": "mine"', CHAT) is None
    # Two "model" keys: the runtime's JSON reads the last, so neither may route the call.
    assert model(host, b'{"model": "a", "messages": [], "model": "b"}', CHAT) is None
    assert counts(host) == {"model_named": 0, "model_absent": 5, "model_malformed": 0}


def test_a_model_past_max_body_bytes_is_not_read() -> None:
    h = WasmHost(CLASSIFY_WASM_PATH)
    assert h.configure(json.dumps({"max_body_bytes": 4096}))
    big = grpc_body(prompt="P" * 6000, model="mine")  # the builder puts the name last
    assert model(h, big) is None
    assert model(h, grpc_body(prompt="P" * 100, model="mine")) == "mine"
    assert (
        model(h, json.dumps({"model": "mine", "prompt": "P" * 6000}).encode(), COMPLETIONS) is None
    )
    assert counts(h) == {"model_named": 1, "model_absent": 2, "model_malformed": 0}


def test_hostile_frames_never_trap_and_never_set_a_malformed_name(host: WasmHost) -> None:
    rng = random.Random(37)
    good = encode_generate_request(GenerateRequest(prompt="Hi there", model="mine"))
    for _ in range(400):
        b = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        got = model(host, frame(bytes(b)[: rng.randint(4, len(b))]))
        assert got is None or (1 <= len(got) <= 128 and got.isascii() and " " not in got)

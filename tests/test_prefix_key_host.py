"""The prefix key (`x-meshlm-prefix`, wasm_filters/prefix.zig) that classify.wasm sets, on the
wasmtime proxy-wasm host: block alignment, chaining, gRPC FlatBuffers and OpenAI JSON bodies,
and what passes unkeyed. `spec_key` is the key's definition written out in Python: the module
must compute exactly it."""

from __future__ import annotations

import hashlib
import json

import pytest
from google.protobuf import wrappers_pb2

from mesh_common.headers import PREFIX_HEADER
from schemas.codec import ChatMessage, GenerateRequest, encode_generate_request
from wasm_filters import classify_xds
from wasm_filters.host import CLASSIFY_WASM_PATH, Decision, WasmHost

GEN = "/meshlm.inference.v1.Inference/Generate"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PREFIX = PREFIX_HEADER
BLOCK, BLOCKS = classify_xds.BLOCK_BYTES, classify_xds.PREFIX_BLOCKS


def spec_key(kind: str, stream: bytes, block: int = BLOCK, blocks: int = BLOCKS) -> str | None:
    link = hashlib.sha256(b"meshlm-prefix-v1\x00" + kind.encode()).digest()
    n = min(len(stream) // block, blocks)
    for i in range(n):
        link = hashlib.sha256(link + stream[i * block : (i + 1) * block]).digest()
    return link[:8].hex() if n else None


def chat_stream(msgs: list[tuple[str, str]]) -> bytes:
    return b"".join(r.encode() + b"\x00" + c.encode() + b"\x00" for r, c in msgs)


def frame(msg: bytes) -> bytes:
    return b"\x00" + len(msg).to_bytes(4, "big") + msg


def grpc_body(**kw: object) -> bytes:
    return frame(encode_generate_request(GenerateRequest(**kw)))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def host() -> WasmHost:
    h = WasmHost(CLASSIFY_WASM_PATH)
    assert h.configure(b"")
    return h


def run(host: WasmHost, data: bytes | list[bytes] | None, path: str = GEN, **hs: str) -> Decision:
    d = host.request({":authority": "llm", **hs}, path=path, grpc=path == GEN, body=data)
    assert d.allowed
    return d


def key(host: WasmHost, data: bytes | list[bytes] | None, path: str = GEN, **hs: str) -> str | None:
    v = run(host, data, path, **hs).header(PREFIX)
    return None if v is None else v.decode()


SYSTEM = "You are a helpful assistant for the ACME support desk. " * 12  # 672 bytes
LONG = "The quick brown fox jumps over the lazy dog, again and again. " * 40


def test_a_prompt_key_is_the_chain_over_its_whole_leading_blocks(host: WasmHost) -> None:
    for n in (64, 65, 127, 128, 200, 1024, 1100, len(LONG)):
        p = LONG[:n]
        assert key(host, grpc_body(prompt=p)) == spec_key("prompt", p.encode()), n


def test_only_whole_blocks_count_and_a_short_prompt_has_no_key(host: WasmHost) -> None:
    assert key(host, grpc_body(prompt="x" * 63)) is None
    a = key(host, grpc_body(prompt=LONG[:64]))
    assert a is not None and len(a) == 16
    assert key(host, grpc_body(prompt=LONG[:127])) == a  # the partial second block is left out
    assert key(host, grpc_body(prompt=LONG[:128])) != a


def test_the_window_is_prefix_blocks_long_and_the_tail_does_not_count(host: WasmHost) -> None:
    head = LONG[: BLOCK * BLOCKS]
    a = key(host, grpc_body(prompt=head + "tail one"))
    assert a == key(host, grpc_body(prompt=head + "another, much longer tail" * 9))
    assert a != key(host, grpc_body(prompt="X" + head))
    # a change inside the window's last block changes the key
    assert a != key(host, grpc_body(prompt=head[:-1] + "#"))


def test_a_chat_key_covers_system_prompt_and_conversation_in_order(host: WasmHost) -> None:
    turn1 = [("system", SYSTEM), ("user", "My order 1234 is late.")]
    turn2 = [*turn1, ("assistant", "Sorry to hear that."), ("user", "Where is it?")]
    k1 = key(host, grpc_body(messages=[ChatMessage(r, c) for r, c in turn1]))
    k2 = key(host, grpc_body(messages=[ChatMessage(r, c) for r, c in turn2]))
    assert k1 == spec_key("chat", chat_stream(turn1))
    assert k2 == spec_key("chat", chat_stream(turn2))
    # a conversation that grows past the window keeps its key
    long_sys = [("system", LONG)]
    assert key(host, grpc_body(messages=[ChatMessage(r, c) for r, c in long_sys])) == key(
        host, grpc_body(messages=[ChatMessage(r, c) for r, c in [*long_sys, ("user", "hi")]])
    )
    # the role counts: the same text as user is another stream
    swapped = [("user", SYSTEM), ("user", "My order 1234 is late.")]
    assert key(host, grpc_body(messages=[ChatMessage(r, c) for r, c in swapped])) != k1


def test_token_ids_are_keyed_by_their_u32_bytes(host: WasmHost) -> None:
    ids = list(range(1000, 1040))
    stream = b"".join(i.to_bytes(4, "little") for i in ids)
    assert key(host, grpc_body(prompt_token_ids=ids)) == spec_key("ids", stream)


def test_openai_json_gets_the_same_key_as_the_same_grpc_call(host: WasmHost) -> None:
    msgs = [("system", SYSTEM), ("user", "Hello")]
    body = {"model": "m", "messages": [{"role": r, "content": c} for r, c in msgs]}
    as_grpc = key(host, grpc_body(messages=[ChatMessage(r, c) for r, c in msgs]))
    assert as_grpc is not None
    assert key(host, json.dumps(body).encode(), CHAT) == as_grpc
    # escapes are decoded, chunks are buffered until the body ends
    raw = json.dumps(body, ensure_ascii=True).replace("A", "\\u0041").encode()
    assert key(host, [raw[:50], raw[50:51], raw[51:]], CHAT) == as_grpc
    # text parts are read in order
    parts = [{"type": "text", "text": SYSTEM[:300]}, {"type": "text", "text": SYSTEM[300:]}]
    body2 = {
        "messages": [{"role": "system", "content": parts}, {"role": "user", "content": "Hello"}]
    }
    assert key(host, json.dumps(body2).encode(), CHAT) == as_grpc
    prompt = {"model": "m", "prompt": LONG, "max_tokens": 3}
    assert key(host, json.dumps(prompt).encode(), COMPLETIONS) == key(host, grpc_body(prompt=LONG))
    assert key(host, json.dumps({"prompt": list(range(1000, 1040))}).encode(), COMPLETIONS) == (
        key(host, grpc_body(prompt_token_ids=list(range(1000, 1040))))
    )


@pytest.mark.parametrize(
    ("path", "data"),
    [
        (CHAT, b"{not json"),
        (CHAT, b'{"messages": "hi"}'),
        (CHAT, b'{"messages": [{"role": 3, "content": "x"}]}'),
        (CHAT, b"[1, 2]"),
        (COMPLETIONS, b'{"prompt": ["a", "b"]}'),
        (COMPLETIONS, b'{"prompt": [-1]}'),
        (GEN, b"\xff" * 40),
        (GEN, b"\x01\x00\x00\x00\x08" + b"\x00" * 8),  # a compressed frame
        (GEN, None),
        (CHAT, None),
    ],
)
def test_a_body_it_cannot_read_passes_unkeyed(
    host: WasmHost, path: str, data: bytes | None
) -> None:
    assert key(host, data, path) is None


def test_a_client_sent_key_is_always_removed(host: WasmHost) -> None:
    spoof = {PREFIX: "0123456789abcdef"}
    assert key(host, grpc_body(prompt="short"), **spoof) is None
    assert key(host, b"{bad", CHAT, **spoof) is None
    assert key(host, b"", "/meshlm.inference.v1.Inference/Info", **spoof) is None
    assert key(host, grpc_body(prompt=LONG), **spoof) == spec_key("prompt", LONG.encode())


def test_a_body_over_the_limit_passes_unkeyed_and_a_large_frame_by_what_arrived() -> None:
    h = WasmHost(CLASSIFY_WASM_PATH)
    assert h.configure(json.dumps({"max_body_bytes": 4096}))
    big = json.dumps({"prompt": LONG * 3}).encode()
    assert key(h, [big[:3000], big[3000:]], COMPLETIONS) is None
    # a gRPC frame over the limit: the blocks inside the first 4096 bytes count
    assert key(h, grpc_body(prompt=LONG * 3)) == spec_key("prompt", (LONG * 3).encode())


def test_block_size_and_window_are_configurable() -> None:
    h = WasmHost(CLASSIFY_WASM_PATH)
    assert h.configure(json.dumps({"block_bytes": 16, "prefix_blocks": 3}))
    assert key(h, grpc_body(prompt=LONG)) == spec_key("prompt", LONG.encode(), 16, 3)
    assert key(h, grpc_body(prompt="x" * 20)) == spec_key("prompt", b"x" * 20, 16, 3)
    for bad in ({"block_bytes": 0}, {"prefix_blocks": 0}, {"block_bytes": 5000}):
        assert not WasmHost(CLASSIFY_WASM_PATH).configure(json.dumps(bad))


def test_the_module_and_the_control_plane_agree_on_the_name_and_the_defaults() -> None:
    zig = (CLASSIFY_WASM_PATH.parent / "classify.zig").read_text()
    assert f'const PREFIX_HEADER = "{PREFIX_HEADER}";' in zig
    assert f"block_bytes: u32 = {BLOCK}," in zig and f"prefix_blocks: u32 = {BLOCKS}," in zig
    settings = wrappers_pb2.StringValue()
    classify_xds.classify_filter_config().config.configuration.Unpack(settings)
    cfg = json.loads(settings.value)
    assert (cfg["block_bytes"], cfg["prefix_blocks"]) == (BLOCK, BLOCKS)

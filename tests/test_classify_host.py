"""classify.wasm on the wasmtime proxy-wasm host: the class header a Generate call gets.

Bodies are real gRPC frames around FlatBuffers built by the project's codec.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import wasmtime

from schemas.codec import ChatMessage, GenerateRequest, encode_generate_request
from wasm_filters.host import _IMPORTS, CLASSIFY_WASM_PATH, Decision, WasmHost

GEN = "/meshlm.inference.v1.Inference/Generate"
HEX16 = re.compile(rb"[0-9a-f]{16}")


def frame(msg: bytes, *, compressed: bool = False) -> bytes:
    """One gRPC length-prefixed message."""
    return bytes([int(compressed)]) + len(msg).to_bytes(4, "big") + msg


def body(**kw: object) -> bytes:
    return frame(encode_generate_request(GenerateRequest(**kw)))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def host() -> WasmHost:
    h = WasmHost(CLASSIFY_WASM_PATH)
    assert h.configure(b"")  # defaults
    return h


def call(host: WasmHost, data: bytes | list[bytes] | None, **headers: str) -> Decision:
    hs = {":authority": "llm", **{k.replace("_", "-"): v for k, v in headers.items()}}
    d = host.request(hs, path=headers.pop("path", GEN), body=data)
    assert d.allowed  # never a local reply: the class filter only labels
    return d


def klass(host: WasmHost, data: bytes | list[bytes] | None, **headers: str) -> bytes | None:
    return call(host, data, **headers).header("x-meshlm-class")


def test_equal_requests_share_a_class_of_16_hex_chars(host: WasmHost) -> None:
    a = klass(host, body(prompt="Why is the sky blue?", request_id="r1", max_new_tokens=8))
    b = klass(host, body(prompt="Why is the sky blue?", request_id="r2", temperature=0.7, seed=3))
    assert a is not None and HEX16.fullmatch(a)
    assert a == b


def test_different_kinds_get_different_classes(host: WasmHost) -> None:
    p = klass(host, body(prompt="Why is the sky blue?"))
    assert klass(host, body(prompt="Why is grass green?")) != p
    assert klass(host, body(prompt="Why is the sky blue?"), **{":authority": "other"}) != p
    as_chat = body(messages=[ChatMessage("user", "Why is the sky blue?")])
    assert klass(host, as_chat) not in (None, p)  # a chat is rendered differently: another kind
    assert klass(host, body(prompt_token_ids=[1, 2, 3])) != klass(
        host, body(prompt_token_ids=[1, 2, 4])
    )


def test_case_and_whitespace_do_not_make_a_new_class(host: WasmHost) -> None:
    a = klass(host, body(prompt="  Why is\tthe   SKY\nblue? "))
    assert a == klass(host, body(prompt="why is the sky blue?"))


def test_only_the_prefix_counts(host: WasmHost) -> None:
    head = "Summarise the following text in one line please thank you kindly: "  # > 64 bytes
    a = klass(host, body(prompt=head + "the cat sat on the mat"))
    assert a == klass(host, body(prompt=head + "a completely different tail"))
    assert a != klass(host, body(prompt="X" + head))


def test_chat_class_is_the_last_user_message(host: WasmHost) -> None:
    def chat(system: str, user: str, reply: str = "") -> bytes:
        msgs = [ChatMessage("system", system), ChatMessage("user", user)]
        if reply:
            msgs.append(ChatMessage("assistant", reply))
        return body(messages=msgs)

    a = klass(host, chat("You are terse.", "List three primes"))
    assert a == klass(host, chat("You are verbose and kind.", "list  three primes"))
    assert a == klass(host, chat("You are terse.", "List three primes", reply="2, 3, 5"))
    assert a != klass(host, chat("You are terse.", "List three squares"))


def test_a_spoofed_class_is_replaced_or_removed(host: WasmHost) -> None:
    spoof = {"x_meshlm_class": "0123456789abcdef"}
    real = klass(host, body(prompt="hello"))
    assert klass(host, body(prompt="hello"), **spoof) == real != b"0123456789abcdef"
    # Not classified (garbage, Info, no body): the client's value is gone all the same.
    assert klass(host, frame(b"\xff" * 40), **spoof) is None
    assert klass(host, frame(b""), path="/meshlm.inference.v1.Inference/Info", **spoof) is None
    assert klass(host, None, **spoof) is None


@pytest.mark.parametrize(
    "data",
    [
        b"\x00\x00",  # shorter than a frame prefix
        frame(b"\xff" * 64),  # offsets out of bounds
        frame(b"\x04\x00\x00\x00" + b"\x00" * 12),  # table points at a vtable of zeros
        frame(encode_generate_request(GenerateRequest(prompt="hi")), compressed=True),
        body(prompt="hi")[:-3],  # the stream ends inside its frame
        body(),  # no prompt, ids or messages
        body(prompt="hi", prompt_token_ids=[1]),  # two of them
    ],
    ids=["short", "oob", "zero-vtable", "compressed", "cut", "none", "two-kinds"],
)
def test_a_body_that_is_not_a_generate_request_passes_unclassified(
    host: WasmHost, data: bytes
) -> None:
    before = host.metrics["meshlm_classify.unclassified.invalid"]
    assert klass(host, data) is None
    assert host.metrics["meshlm_classify.unclassified.invalid"] == before + 1


def test_a_body_in_many_chunks_gets_the_class_of_the_whole(host: WasmHost) -> None:
    whole = body(messages=[ChatMessage("user", "tell me a story " * 20)])
    chunks = [whole[i : i + 7] for i in range(0, len(whole), 7)]
    assert klass(host, chunks) == klass(host, whole) is not None


def test_info_and_other_paths_are_not_paused_or_classified(host: WasmHost) -> None:
    d = call(host, [b"\x00\x00\x00\x00\x00", b""], path="/meshlm.inference.v1.Inference/Info")
    assert d.header("x-meshlm-class") is None


def test_a_body_over_the_limit_is_classified_by_its_prefix() -> None:
    h = WasmHost(CLASSIFY_WASM_PATH)
    assert h.configure(json.dumps({"max_body_bytes": 1024}))
    # Token ids lie in front of the prompt string in the codec's layout: 4000 ids, 16 KB.
    big = body(prompt_token_ids=list(range(4000)))
    other_tail = body(prompt_token_ids=list(range(16)) + [7] * 3984)
    a = klass(h, [big[i : i + 512] for i in range(0, len(big), 512)])
    assert a is not None and a == klass(h, other_tail)
    assert a != klass(h, body(prompt_token_ids=[9] * 4000))
    assert h.metrics["meshlm_classify.classified_by_prefix"] == 3
    # A long prompt whose start arrived gets the class it gets whole (first 64 bytes count).
    long_prompt = "why do cats purr so loudly when they sleep in the sun all day " * 300
    whole = WasmHost(CLASSIFY_WASM_PATH)
    assert whole.configure(json.dumps({"max_body_bytes": 512 * 1024}))
    cut = klass(h, body(prompt=long_prompt))
    assert cut is not None and cut == klass(whole, body(prompt=long_prompt))


def test_no_prompt_text_in_headers_or_logs(host: WasmHost) -> None:
    secret = "my card number is 4111 1111 1111 1111"
    d = call(host, body(prompt=secret), x_trace="t")
    texts = [v for _, v in d.request_headers] + [m.encode() for _, m in host.logs]
    assert not any(b"4111" in t or b"card" in t for t in texts)


@pytest.mark.parametrize(
    "config",
    [
        '{"prefix_bytes": 0}',
        '{"max_body_bytes": 10}',
        '{"max_body_bytes": 99999999}',
        '{"prefix_byte": 8}',
        "not json",
    ],
)
def test_a_bad_configuration_is_refused(config: str) -> None:
    h = WasmHost(CLASSIFY_WASM_PATH)
    assert h.configure(json.dumps({"prefix_bytes": 8}))
    assert not h.configure(config)
    assert any(level == "error" and "rejected configuration" in m for level, m in h.logs)
    # The last good configuration still serves: 8 bytes of prefix.
    assert klass(h, body(prompt="abcdefgh-1")) == klass(h, body(prompt="abcdefgh-2"))


def test_hostile_bodies_never_trap_or_hang(host: WasmHost) -> None:
    """Mutations of valid requests: the filter labels or passes, never traps, never stalls."""
    rng = random.Random(11)
    seeds = [
        body(prompt="hello world", stop=["x"]),
        body(messages=[ChatMessage("system", "s"), ChatMessage("user", "u" * 40)]),
        body(prompt_token_ids=list(range(50))),
    ]
    for _ in range(1500):
        b = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(5, len(b))
            b[i] = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
        cut = rng.random() < 0.2
        data = bytes(b[: rng.randrange(5, len(b))]) if cut else bytes(b)
        if cut:  # keep the prefix honest so the truncation is a prefix, not an early end
            data = data[:1] + (len(b) - 5).to_bytes(4, "big") + data[5:]
        d = call(host, data)
        v = d.header("x-meshlm-class")
        assert v is None or HEX16.fullmatch(v)


def test_module_speaks_proxy_wasm_0_2_1_with_body_callbacks() -> None:
    module = wasmtime.Module.from_file(wasmtime.Engine(), str(CLASSIFY_WASM_PATH))
    exports = {e.name for e in module.exports}
    assert exports >= {"proxy_abi_version_0_2_1", "proxy_on_request_body", "memory"}
    assert {(i.module, i.name) for i in module.imports} <= {("env", n) for n, _, _ in _IMPORTS}
    assert CLASSIFY_WASM_PATH.stat().st_size < 200_000


def test_a_resumed_stream_keeps_the_class_of_its_request(host: WasmHost) -> None:
    """Issue 10's resume fields are not the request's kind: a query of death resumed on another
    replica is still the same class."""
    first = klass(host, body(prompt="crash me", request_id="a"))
    resumed = body(prompt="crash me", resume_token_ids=[5, 6], resume_index=2, avoid_replica="v1-0")
    assert klass(host, resumed) == first is not None

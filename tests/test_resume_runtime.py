"""Resuming a stream another replica started (issue 10), over real gRPC with the real model:
the resumed stream is the uninterrupted one from the resume point on, token for token and byte
for byte, with continuing chunk indexes; the runtime names itself and refuses to be resumed on
when asked to avoid itself. Every comparison is with an uninterrupted stream computed here."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from mesh_common.headers import REPLICA_HEADER
from model_runtime.engine.engine import Engine, GenerateParams
from model_runtime.serving.client import Client
from model_runtime.serving.service import Runtime
from schemas import codec
from tests.runtime_fixtures import serving_runtime
from tests.test_engine_scheduler import chat, run

STORY = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
SEEDED = {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 7}


@pytest.fixture(scope="module")
def runtime(smollm_int4) -> Iterator[Runtime]:
    rt = serving_runtime(smollm_int4, replica_id="replica-a")
    try:
        yield rt
    finally:
        rt.shutdown(grace=5)


@pytest.fixture(scope="module")
def client(runtime) -> Iterator[Client]:
    with Client(runtime.target) as c:
        yield c


def ids_of(chunks: list[codec.TokenChunk]) -> list[int]:
    return [int(t) for c in chunks for t in c.token_ids]


def text_of(chunks: list[codec.TokenChunk]) -> str:
    return "".join(c.text_delta for c in chunks)


def stream(client: Client, **kw) -> list[codec.TokenChunk]:
    return list(client.generate(messages=STORY, timeout=120, **kw))


def raw(client: Client, req: codec.GenerateRequest):
    """A call without the client's own validation: what the server alone decides."""
    call = client.generate_raw(codec.encode_generate_request(req), timeout=60)
    return call, [codec.decode_token_chunk(b) for b in call]


@pytest.mark.parametrize("sampling", [{}, SEEDED], ids=["greedy", "seeded"])
def test_resume_after_5_tokens_is_the_uninterrupted_stream(client, sampling) -> None:
    full = stream(client, max_new_tokens=12, **sampling)
    assert len(full) > 6, "the reference stream must go past the resume point"
    delivered = full[:5]  # one token per chunk: what a caller holds when the stream breaks
    resumed = stream(
        client,
        max_new_tokens=12,
        resume_token_ids=ids_of(delivered),
        resume_index=5,
        **sampling,
    )
    assert [c.index for c in resumed] == list(range(5, 5 + len(resumed)))
    assert ids_of(delivered) + ids_of(resumed) == ids_of(full)
    assert text_of(delivered) + text_of(resumed) == text_of(full)
    assert resumed[-1].finish_reason == full[-1].finish_reason


def test_resume_inside_a_multibyte_character_loses_no_byte(client) -> None:
    emojis = [{"role": "user", "content": "Reply with three dragon emojis."}]
    full = list(client.generate(messages=emojis, max_new_tokens=10, timeout=120))
    # The first point where a chunk's token held back an incomplete character.
    k = next((i + 1 for i, c in enumerate(full[:-1]) if i and not c.text_delta), None)
    assert k is not None, [c.text_delta for c in full]
    resumed = list(
        client.generate(
            messages=emojis,
            max_new_tokens=10,
            resume_token_ids=ids_of(full[:k]),
            resume_index=k,
            timeout=120,
        )
    )
    assert text_of(full[:k]) + text_of(resumed) == text_of(full)
    assert "\ufffd" not in text_of(resumed[:-1])


def test_stop_sequence_across_the_resume_boundary(client) -> None:
    plain = stream(client, max_new_tokens=12)
    # A stop string that begins before the resume point and ends after it.
    start = len(text_of(plain[:4])) - 2
    stop = text_of(plain)[start : len(text_of(plain[:7]))]
    assert stop.strip(), "the stop sequence must be real text"
    full = stream(client, max_new_tokens=12, stop=[stop])
    assert full[-1].finish_reason == "stop"
    delivered = [c for c in full if c.index < 5]
    resumed = stream(
        client, max_new_tokens=12, stop=[stop], resume_token_ids=ids_of(delivered), resume_index=5
    )
    assert text_of(delivered) + text_of(resumed) == text_of(full)
    assert ids_of(delivered) + ids_of(resumed) == ids_of(full)
    assert resumed[-1].finish_reason == "stop" and stop not in text_of(full)


def test_resume_ids_count_against_max_new_tokens(client) -> None:
    full = stream(client, max_new_tokens=8)
    assert len(ids_of(full)) == 8 and full[-1].finish_reason == "length"
    resumed = stream(client, max_new_tokens=8, resume_token_ids=ids_of(full[:5]), resume_index=5)
    assert ids_of(resumed) == ids_of(full)[5:]  # 3 more tokens, not 8
    assert resumed[-1].finish_reason == "length"
    # Everything already delivered: one final chunk, no token, nothing run.
    done = stream(client, max_new_tokens=8, resume_token_ids=ids_of(full), resume_index=8)
    assert [(c.index, ids_of([c]), c.finish_reason) for c in done] == [(8, [], "length")]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"prompt_token_ids": [1, 2], "resume_token_ids": [5, 49152]}, "outside [0, 49152)"),
        ({"prompt_token_ids": [1, 2], "resume_token_ids": [-3]}, "outside"),
        ({"prompt": "Hi", "max_new_tokens": 2, "resume_token_ids": [5, 6, 7]}, "max_new_tokens"),
        (
            {"prompt_token_ids": [1] * 8000, "max_new_tokens": 400, "resume_token_ids": [5] * 300},
            "no room in the context",
        ),
        (  # a text prompt is only measured once tokenized, by the runtime
            {"prompt": "word " * 8000, "max_new_tokens": 300, "resume_token_ids": [5] * 200},
            "no room in the context",
        ),
        ({"prompt": "Hi", "resume_token_ids": [5] * 9000}, "exceed the limit"),
    ],
    ids=["vocab", "negative", "max-new-tokens", "context-ids", "context-text", "count"],
)
def test_bad_resume_input_is_invalid_argument_naming_the_field(client, fields, words) -> None:
    with pytest.raises(grpc.RpcError) as e:
        raw(client, codec.GenerateRequest(**fields))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("resume_token_ids:") and words in e.value.details()


def test_every_stream_names_its_replica_before_the_first_chunk(client, runtime) -> None:
    call = client.generate_raw(
        codec.encode_generate_request(codec.GenerateRequest(prompt="Hi", max_new_tokens=2)),
        timeout=60,
    )
    assert (REPLICA_HEADER, "replica-a") in call.initial_metadata()
    assert len(list(call)) >= 1 and call.code() == grpc.StatusCode.OK
    assert runtime.replica_id == "replica-a"


def test_default_replica_id_is_the_listener_address(smollm_int4) -> None:
    engine = Engine(smollm_int4, max_batch=1, max_queue=1)
    engine.start()
    rt = Runtime("127.0.0.1:0").start()
    rt.set_model(smollm_int4, engine)
    try:
        with Client(rt.target) as c:
            req = codec.GenerateRequest(prompt="Hi", max_new_tokens=1)
            call, chunks = raw(c, req)
        assert rt.replica_id == rt.target == f"127.0.0.1:{rt.port}"
        assert (REPLICA_HEADER, rt.target) in call.initial_metadata() and chunks
    finally:
        rt.shutdown(grace=1)


def test_resume_naming_this_replica_is_refused_before_any_header(client) -> None:
    req = codec.GenerateRequest(
        prompt="Hi",
        max_new_tokens=4,
        resume_token_ids=[5],
        resume_index=1,
        avoid_replica="replica-a",
    )
    call = client.generate_raw(codec.encode_generate_request(req), timeout=60)
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "avoid_replica" in e.value.details() and "replica-a" in e.value.details()
    assert not call.initial_metadata()  # trailers only: the sidecar may still retry elsewhere
    assert (REPLICA_HEADER, "replica-a") in call.trailing_metadata()
    # Another replica's id is no reason to refuse.
    ok = stream(client, max_new_tokens=2, avoid_replica="replica-b")
    assert ok[-1].finish_reason in ("stop", "length")


def test_a_resume_reuses_the_prefix_cache_for_the_prompt_and_delivered_ids(
    client, runtime, smollm_int4
) -> None:
    full = stream(client, max_new_tokens=20)
    k = runtime.engine.block_size + 1  # the delivered ids fill at least one more block
    assert len(full) > k
    before = runtime.engine.stats()["prefix_hit_tokens"]
    stream(client, max_new_tokens=20, resume_token_ids=ids_of(full[:k]), resume_index=k)
    n_context = len(smollm_int4.tokenizer.encode_chat(STORY)) + k
    block = runtime.engine.block_size
    # Every full block of prompt + delivered ids is reused; the last token is always computed.
    hits = runtime.engine.stats()["prefix_hit_tokens"] - before
    assert hits == block * ((n_context - 1) // block) > 0


def _engine_ids(loaded, params: GenerateParams) -> list[int]:
    """The token ids a fresh Engine (nothing in its prefix cache) sends for `params`."""
    engine = Engine(loaded, max_batch=2)
    engine.start()
    try:
        return run(engine, [params])[0].ids
    finally:
        engine.shutdown(drain_timeout=5)


@pytest.mark.parametrize(
    ("prompt", "k"), [("Say hello in Spanish.", 1), ("Name a primary colour.", 5)]
)
def test_a_resume_where_nothing_is_cached_goes_on_as_the_uninterrupted_stream(
    smollm_int4, prompt: str, k: int
) -> None:
    """A replica that never saw the stream: the delivered ids go into its cache by one decode
    step each, as they went into the first replica's. Prefilled with the prompt instead, they
    gave other logits than those steps, and on an AMD EPYC these two resume points then chose
    another token at a near-tie (`meshlm demo --scenario stall` resumed a stream no replica
    would have sent)."""
    full = _engine_ids(smollm_int4, chat(smollm_int4, prompt, max_new_tokens=10))
    assert len(full) > k
    resumed = _engine_ids(
        smollm_int4, chat(smollm_int4, prompt, max_new_tokens=10, resume_ids=full[:k])
    )
    assert resumed == full[k:]

"""The client's fast path for token chunks (issue 13, item 4) against the verifier + generated
reader: on every buffer it either declines or answers exactly as they do, and every chunk the
server's fixed-layout encoder writes takes it."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import codec as c
from tests.fuzz import codec as fuzz

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)


@FUZZ
@given(
    st.text(max_size=40),
    U32,
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20),
    st.text(max_size=40),
    st.sampled_from(c.FINISH_REASONS[:4]),
    U64,
    st.one_of(st.none(), U64),
)
def test_every_chunk_the_server_writes_takes_the_fast_path(
    rid: str, index: int, ids: list[int], text: str, finish: str | None, wait: int, ttft: int | None
) -> None:
    buf = c.encode_token_chunk(rid, index, ids, text, finish, wait, ttft)
    got = c.decode_token_chunk_fixed(buf)
    assert got is not None, "the fixed layout fell back to the verifier"
    assert (got.request_id, got.index, got.token_ids.tolist(), got.text_delta) == (
        rid,
        index,
        ids,
        text,
    )
    assert (got.finish_reason, got.queue_wait_us, got.ttft_us, got.error) == (
        finish,
        wait,
        ttft,
        None,
    )
    assert not got.token_ids.flags.owndata  # still a zero-copy view of the received buffer
    assert fuzz.check_chunk(buf) == "fast"


def test_chunks_with_an_error_table_or_not_bytes_use_the_verifier() -> None:
    err = c.encode_token_chunk("r", 3, [], "", "error", 0, None, c.ErrorInfo(13, "boom", "x"))
    fixed = fuzz.FIXED_CHUNKS[0]
    assert c.decode_token_chunk_fixed(err) is None
    assert c.decode_token_chunk(err).error == c.ErrorInfo(13, "boom", "x")
    for view in (bytearray(fixed), memoryview(fixed)):
        assert c.decode_token_chunk_fixed(view) is None
        assert c.decode_token_chunk(view).text_delta == " Paris"


def test_every_byte_value_at_every_position() -> None:
    """Exhaustive single-byte substitutions: 256 values at each byte of a fixed-layout chunk."""
    buf, seen = fuzz.FIXED_CHUNKS[0], set()
    for pos in range(len(buf)):
        b = bytearray(buf)
        for value in range(256):
            b[pos] = value
            seen.add(fuzz.check_chunk(bytes(b)))
    assert seen == {"fast", "verified", "WireError"}


CHUNK_IDS = [f"chunk{i}" for i in range(len(fuzz.FIXED_CHUNKS))]


@pytest.mark.parametrize("buf", fuzz.FIXED_CHUNKS, ids=CHUNK_IDS)
def test_special_byte_values_at_every_position(buf: bytes) -> None:
    for pos in range(len(buf)):
        b = bytearray(buf)
        for value in {0, 1, 0x7F, 0x80, 0xC3, 0xED, 0xFF, buf[pos] ^ 1, buf[pos] ^ 0x80}:
            b[pos] = value
            fuzz.check_chunk(bytes(b))


@pytest.mark.parametrize("buf", fuzz.FIXED_CHUNKS, ids=CHUNK_IDS)
def test_hostile_u32_at_every_aligned_position_and_every_truncation(buf: bytes) -> None:
    for pos in range(0, len(buf) - 3, 4):
        old = struct.unpack_from("<I", buf, pos)[0]
        for value in {*fuzz.HOSTILE_U32, old - 4, old - 1, old + 1, old + 4, len(buf)}:
            b = bytearray(buf)
            struct.pack_into("<I", b, pos, value % 2**32)
            fuzz.check_chunk(bytes(b))
    for cut in range(len(buf)):
        assert fuzz.check_chunk(buf[:cut]) == "WireError"
    # Trailing bytes and a smaller limit: the verifier's answer, whatever the fast path does.
    fuzz.check_chunk(buf + b"\0\0\0\0")
    with pytest.raises(c.WireError, match="exceeds the limit"):
        c.decode_token_chunk(buf, max_size=len(buf) - 1)


def test_a_chunk_over_the_size_limit_is_refused_on_the_fast_path_too() -> None:
    buf = c.encode_token_chunk("r", 0, [1], "x" * c.DEFAULT_LIMITS.max_buffer_bytes)
    assert fuzz.check_chunk(buf) == "WireError"
    with pytest.raises(c.WireError, match="exceeds the limit"):
        c.decode_token_chunk(buf)


@pytest.mark.parametrize("size", [512, 2048, 1 << 14])
def test_aliased_chunk_strings_are_left_to_the_verifier_budget(size: int) -> None:
    buf = fuzz.aliased_chunk(size)
    outcome = fuzz.check_chunk(buf)
    assert outcome == ("verified" if size <= 2048 else "WireError")


@pytest.mark.parametrize("seed", [1, 2])
def test_mutated_chunks_differential(seed: int) -> None:
    seen = fuzz.run(1500, seed=seed, chunks=True)
    assert seen["fast"] and seen["verified"] and seen["WireError"], seen


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_behind_the_fixed_header(tail: bytes) -> None:
    # Random bytes after the fixed header: reach the fast path's bounds checks, not only its
    # header comparison.
    head = fuzz.FIXED_CHUNKS[0][:32]
    fuzz.check_chunk(head + tail)
    fuzz.check_chunk(fuzz.FIXED_CHUNKS[0][: len(tail)] + tail)


def test_the_runtime_streams_chunks_the_fast_path_reads(smollm_int4) -> None:
    """Over real gRPC from the real runtime: every chunk arrives as bytes in the fixed layout."""
    from model_runtime.serving.client import Client
    from tests.runtime_fixtures import serving_runtime

    rt = serving_runtime(smollm_int4)
    try:
        with Client(rt.target) as client:
            req = c.GenerateRequest(prompt="The capital of France is", max_new_tokens=6)
            bufs = list(client.generate_raw(c.encode_generate_request(req), timeout=120))
    finally:
        rt.shutdown(grace=5)
    assert len(bufs) > 1 and c.decode_token_chunk_verified(bufs[-1]).finish_reason is not None
    for buf in bufs:
        assert type(buf) is bytes and c.decode_token_chunk_fixed(buf) is not None
        assert fuzz.check_chunk(buf) == "fast"

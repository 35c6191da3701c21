"""Hostile buffers never crash the codec: they raise WireError, or decode to a valid message.

Random bytes, truncations, bit flips, overwritten offsets, and offsets aliasing one object. A bit
flip inside a string's bytes can yield another valid request, so for flips and overwrites the
property is "WireError or a request that passes every value check"; a truncated buffer is always
refused (unless only the alignment padding after its last string is gone).
"""

from __future__ import annotations

import contextlib
import functools
import struct
import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import codec as c
from tests.fuzz import codec as fuzz

LIMITS = c.Limits(context_length=2048, vocab_size=49152)
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

VALID = [
    c.encode_generate_request(
        c.GenerateRequest(
            request_id="fuzz-1", prompt="Hello, world", stop=["\n"], seed=3, max_new_tokens=4
        )
    ),
    c.encode_generate_request(
        c.GenerateRequest(
            messages=[c.ChatMessage("system", "brief"), c.ChatMessage("user", "hi ✓")],
            priority=2,
            top_p=0.5,
        )
    ),
    c.encode_generate_request(c.GenerateRequest(prompt_token_ids=[1, 2, 3, 4], model="m")),
]
CHUNKS = [
    c.encode_token_chunk("r", 2, [17, 18], " Paris", None, 10, 20),
    c.encode_token_chunk("r", 3, [], "", "error", 0, None, c.ErrorInfo(13, "boom", "x")),
]


def _request_or_wire_error(buf: bytes) -> c.GenerateRequest | None:
    try:
        req = c.decode_generate_request(buf, LIMITS)
    except c.WireError as e:
        assert e.field and e.message
        return None
    c.validate_generate_request(req, LIMITS)  # anything accepted is a valid request
    return req


def _chunk_or_wire_error(buf: bytes) -> None:
    fuzz.check_chunk(buf)  # and the client's fast path answers as the verifier does (issue 13)


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes(buf: bytes) -> None:
    _request_or_wire_error(buf)
    _chunk_or_wire_error(buf)
    with contextlib.suppress(c.WireError):
        c.decode_model_info(buf)


@FUZZ
@given(st.sampled_from(VALID + CHUNKS), st.data())
def test_truncated_buffers_are_refused(buf: bytes, data: st.DataObject) -> None:
    # Every buffer here ends with a string; only the alignment padding after its NUL may go.
    needed = len(buf.rstrip(b"\0")) + 1
    cut = data.draw(st.integers(0, len(buf) - 1))
    decode = c.decode_token_chunk if buf in CHUNKS else c.decode_generate_request
    if cut >= needed:
        decode(buf[:cut])
        return
    try:
        decode(buf[:cut])
    except c.WireError:
        return
    raise AssertionError(f"a buffer truncated to {cut}/{len(buf)} bytes was accepted")


@FUZZ
@given(st.sampled_from(VALID + CHUNKS), st.data())
def test_bit_flips(buf: bytes, data: st.DataObject) -> None:
    b = bytearray(buf)
    for _ in range(data.draw(st.integers(1, 4))):
        bit = data.draw(st.integers(0, len(b) * 8 - 1))
        b[bit // 8] ^= 1 << (bit % 8)
    _request_or_wire_error(bytes(b))
    _chunk_or_wire_error(bytes(b))


MODEL_INFO = c.encode_model_info(
    c.ModelInfo("m", "int4", "m@1:int4", 2048, 49152, "bf16", "int4 weights on ✓ kernels", "torch")
)


@FUZZ
@given(st.data())
def test_model_info_truncated_or_flipped(data: st.DataObject) -> None:
    # ModelInfo with the compute fields (issue 13): it ends with a string, so every cut before
    # its NUL is refused; bit flips give a WireError or a ModelInfo of strings.
    buf = MODEL_INFO
    cut = data.draw(st.integers(0, len(buf.rstrip(b"\0"))))
    try:
        c.decode_model_info(buf[:cut])
    except c.WireError as e:
        assert e.field and e.message
    else:
        raise AssertionError(f"a ModelInfo truncated to {cut}/{len(buf)} bytes was accepted")
    b = bytearray(buf)
    for _ in range(data.draw(st.integers(1, 4))):
        bit = data.draw(st.integers(0, len(b) * 8 - 1))
        b[bit // 8] ^= 1 << (bit % 8)
    with contextlib.suppress(c.WireError):
        info = c.decode_model_info(bytes(b))
        assert all(isinstance(s, str) for s in (info.compute_dtype, info.compute, info.kernels))


HOSTILE = st.one_of(
    st.sampled_from([0, 1, 2, 3, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFC, 0x10000]),
    st.integers(0, 2**32 - 1),
)


@FUZZ
@given(st.sampled_from(VALID + CHUNKS), st.data(), HOSTILE)
def test_hostile_offsets(buf: bytes, data: st.DataObject, value: int) -> None:
    b = bytearray(buf)
    pos = data.draw(st.integers(0, len(b) // 4 - 1)) * 4
    b[pos : pos + 4] = struct.pack("<I", value)
    _request_or_wire_error(bytes(b))
    _chunk_or_wire_error(bytes(b))


_aliased = functools.lru_cache(fuzz.aliased)  # building 4000 tables in Python takes a while


@FUZZ
@given(
    st.sampled_from(sorted(fuzz.ALIASED)), st.sampled_from([256, 4096, 1 << 15]), st.data(), HOSTILE
)
def test_aliased_offsets_cost_at_most_the_buffer(
    shape: str, size: int, data: st.DataObject, value: int
) -> None:
    # A shared-offset request, perhaps with one u32 overwritten (a count, a length, an offset):
    # whatever the decoder answers, it copies no more than about the buffer's own size (plus
    # the Python objects of at most 256 messages and 16 stop strings).
    b = bytearray(_aliased(shape, size))
    if data.draw(st.booleans()):
        pos = data.draw(st.integers(0, len(b) // 4 - 1)) * 4
        b[pos : pos + 4] = struct.pack("<I", value)
    # once untraced first: what a first decode builds lazily (caches, interned names) is paid
    # once per process, not per buffer (a first example of 4 KiB measured 118 KB, its rerun not)
    _request_or_wire_error(bytes(b))
    tracemalloc.start()
    try:
        _request_or_wire_error(bytes(b))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(b) + (64 << 10), f"{peak} bytes allocated for a {len(b)}-byte buffer"

"""Long-run fuzzing of the runtime's FlatBuffers decoding (what `meshlm serve` runs on every
request): structure-aware mutations of valid buffers, seeded and reproducible.

    .venv/bin/python -m tests.fuzz.codec --inputs 100000 [--seed 1]

Property, for every input: the decoders either raise `WireError` (the runtime answers
INVALID_ARGUMENT with its message) or return a message that passes every value check. Any
other exception is a bug; the input is written to `--crashes` and the run fails.
The default test run covers the same property with a bounded count (tests/test_fuzz_codec.py).
The seeds include `aliased()` requests whose offsets point many times at one object (issue 9),
and token chunks in the server's fixed layout, on which `check_chunk` compares the client's fast
path with the verifier + generated reader (issue 13: same answer, or the fast path declines);
`--chunks` mutates only token chunks.

    .venv/bin/python -m tests.fuzz.codec --aliased stop

decodes one such 1 MiB request and prints the CPU seconds and peak RSS it cost.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import resource
import struct
import sys
import time
from collections import Counter
from pathlib import Path

import flatbuffers
import numpy as np

from schemas import codec as c
from schemas.meshlm import inference_generated as fb

LIMITS = c.Limits(context_length=2048, vocab_size=49152)
# aliased() shapes: (what aliases, how many times; None = as many as fit)
ALIASED: dict[str, tuple[str, int | None]] = {
    "stop": ("stop", None),
    "stop16": ("stop", 16),
    "content": ("content", 4000),
    "content256": ("content", 256),
    "table": ("table", 4000),
    "wide": ("wide", None),
}

SEEDS = [
    c.encode_generate_request(
        c.GenerateRequest(
            request_id="f",
            prompt="Hello",
            stop=["\n", "."],
            seed=3,
            max_new_tokens=4,
            temperature=0.7,
            top_p=0.9,
            top_k=5,
        )
    ),
    c.encode_generate_request(
        c.GenerateRequest(
            messages=[c.ChatMessage("system", "brief"), c.ChatMessage("user", "hi ✓ ünï")],
            priority=2,
        )
    ),
    c.encode_generate_request(c.GenerateRequest(prompt_token_ids=list(range(40)), model="m")),
    c.encode_token_chunk("r", 3, [], "", "error", 0, None, c.ErrorInfo(13, "boom", "x")),
    c.encode_info_request(),
    c.encode_model_info(
        c.ModelInfo(
            "SmolLM2-135M-Instruct",
            "bf16",
            "SmolLM2@ab12:bf16",
            8192,
            49152,
            compute_dtype="fp32",
            compute="bf16 weights computed in fp32 (✓)",
            kernels="torch",
        )
    ),
]
# Chunks in the fixed layout the server writes: ttft set or null, text lengths 0-4 mod 4 (every
# padding), multi-byte UTF-8, no tokens, the largest scalars.
FIXED_CHUNKS = [
    c.encode_token_chunk("r", 2, [17, 18], " Paris", None, 10, 20),
    c.encode_token_chunk("req-0001", 0, [5364], "The", None, 1234, None),
    c.encode_token_chunk("", 7, [], "", "stop", 0, 0),
    c.encode_token_chunk("réq-✓", 2**32 - 1, [0, 49151, -1], "ünï", "length", 2**64 - 1, 2**64 - 1),
    c.encode_token_chunk("abcd", 9, [1, 2, 3, 4], "four", "cancelled", 1, 2),
    c.encode_token_chunk("a" * 40, 1, list(range(16)), "x\x00y", None, 3, 4),
]


def aliased(shape: str, size: int = 1 << 20) -> bytes:
    """A well-formed GenerateRequest of about `size` bytes whose offsets alias one object
    (issue 9, defect 1: each alias used to be verified and copied again). Shapes (ALIASED):

    - "stop": a stop vector of `size / 8` offsets to one string of half the buffer;
    - "stop16": 16 stop offsets (the count limit) to one string that fills the buffer;
    - "content": 4000 ChatMessages (under the verifier's table count) sharing one content string;
    - "content256": 256 ChatMessages (the count limit) sharing one content string;
    - "table": a messages vector of 4000 offsets to one ChatMessage with such a content;
    - "wide": a stop vector of as many distinct one-byte strings as fit (no aliasing).
    """
    kind, count = ALIASED[shape]
    b = flatbuffers.Builder(size + 1024)
    if kind == "wide":
        offsets = [b.CreateString("x") for _ in range(size // 12)]
    elif kind == "stop":
        big = size // 2 if count is None else size - 128
        offsets = [b.CreateString("y" * big)] * (count or (size - big) // 4)
    else:
        role, content = b.CreateString("user"), b.CreateString("y" * (size - 16 * count - 64))
        offsets = []
        for _ in range(1 if kind == "table" else count):
            fb.ChatMessageStart(b)
            fb.ChatMessageAddRole(b, role)
            fb.ChatMessageAddContent(b, content)
            offsets.append(fb.ChatMessageEnd(b))
        offsets *= count if kind == "table" else 1
    vec = c._offset_vector(b, offsets)
    prompt = b.CreateString("Hello") if kind in ("stop", "wide") else 0
    fb.GenerateRequestStart(b)
    if prompt:
        fb.GenerateRequestAddPrompt(b, prompt)
        fb.GenerateRequestAddStop(b, vec)
    else:
        fb.GenerateRequestAddMessages(b, vec)
    b.Finish(fb.GenerateRequestEnd(b))
    return bytes(b.Output())


def aliased_chunk(size: int) -> bytes:
    """A TokenChunk whose request_id, text_delta and error message and field are one shared
    string of about `size` bytes: accepted while the four reads fit the verifier's budget
    (2 x the buffer + 4 KiB), refused beyond; never the fixed layout."""
    b = flatbuffers.Builder(size + 256)
    s = b.CreateString("y" * (size - 128))
    fb.ErrorStart(b)
    fb.ErrorAddCode(b, 13)
    fb.ErrorAddMessage(b, s)
    fb.ErrorAddField(b, s)
    err = fb.ErrorEnd(b)
    ids = b.CreateNumpyVector(np.asarray([1, 2], dtype="<i4"))
    fb.TokenChunkStart(b)
    fb.TokenChunkAddRequestId(b, s)
    fb.TokenChunkAddTokenIds(b, ids)
    fb.TokenChunkAddTextDelta(b, s)
    fb.TokenChunkAddFinishReason(b, 4)
    fb.TokenChunkAddError(b, err)
    b.Finish(fb.TokenChunkEnd(b))
    return bytes(b.Output())


# Mutating aliased buffers reaches the count limits and the verifier's budget from both sides.
SEEDS += [aliased(shape, 4096) for shape in ALIASED]
CHUNK_SEEDS = [*FIXED_CHUNKS, SEEDS[3], aliased_chunk(1024), aliased_chunk(4096)]
SEEDS += CHUNK_SEEDS
HOSTILE_U32 = [0, 1, 2, 3, 4, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFC, 0x10000, 0xFFFF]


def mutate(rng: random.Random, buf: bytes) -> bytes:
    """One to four stacked mutations of `buf`."""
    b = bytearray(buf)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(10)
        n = len(b)
        if op == 0 and n:  # bit flip
            i = rng.randrange(n * 8)
            b[i // 8] ^= 1 << (i % 8)
        elif op == 1 and n >= 4:  # a hostile u32 at an aligned offset (offsets, lengths)
            pos = rng.randrange(n // 4) * 4
            b[pos : pos + 4] = struct.pack("<I", rng.choice([*HOSTILE_U32, rng.getrandbits(32)]))
        elif op == 2 and n >= 2:  # a hostile i16/u16 (vtable entries)
            pos = rng.randrange(n // 2) * 2
            b[pos : pos + 2] = struct.pack("<H", rng.choice([0, 1, 4, 0x7FFF, 0xFFFF, n & 0xFFFF]))
        elif op == 3:  # truncate
            del b[rng.randrange(n + 1) :]
        elif op == 4:  # extend with garbage or zeros
            b += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))
        elif op == 5 and n:  # splice another seed's tail
            other = rng.choice(SEEDS)
            cut = rng.randrange(n)
            b = b[:cut] + other[rng.randrange(len(other)) :]
        elif op == 6 and n:  # duplicate a region (aliasing offsets)
            i, j = sorted(rng.randrange(n) for _ in range(2))
            b[j:j] = b[i:j]
        elif op == 7 and n:  # overwrite a byte with a special value
            b[rng.randrange(n)] = rng.choice([0, 0x7F, 0x80, 0xFF, 0xC3, 0xED])
        elif op == 8:  # random bytes
            b = bytearray(rng.getrandbits(8) for _ in range(rng.randint(0, 128)))
        elif op == 9 and n >= 8:  # aim the u32 at q where the one at p points (aliasing)
            p, q = (rng.randrange(n // 4) * 4 for _ in range(2))
            target = p + struct.unpack_from("<I", b, p)[0]
            if q < target < n:
                struct.pack_into("<I", b, q, target - q)
    return bytes(b)


def check(buf: bytes) -> str:
    """Run every decoder on `buf`; return how the request decoder answered."""
    outcome = "accepted"
    try:
        req = c.decode_generate_request(buf, LIMITS)
        c.validate_generate_request(req, LIMITS)
    except c.WireError as e:
        assert e.field and e.message, "a WireError must name the field"
        outcome = "WireError"
    check_chunk(buf)
    for decode in (c.decode_model_info, c.decode_info_request):
        with contextlib.suppress(c.WireError):
            decode(buf)
    return outcome


def _same(a: c.TokenChunk, b: c.TokenChunk) -> bool:
    return repr(a) == repr(b) and a.token_ids.dtype == b.token_ids.dtype == "<i4"


def check_chunk(buf: bytes) -> str:
    """Decode `buf` as a TokenChunk three ways: the fixed-layout fast path, the verifier +
    generated reader, and `decode_token_chunk` (what clients call). The fast path either declines
    (None) or returns what the verified path returns; it never accepts a buffer the verifier
    refuses, and `decode_token_chunk` answers exactly as the verified path (same chunk, or a
    WireError with the same field and message). Returns "fast", "verified" or "WireError"."""
    try:
        full: c.TokenChunk | c.WireError = c.decode_token_chunk_verified(buf)
    except c.WireError as e:
        assert e.field and e.message, "a WireError must name the field"
        full = e
    fast = c.decode_token_chunk_fixed(buf)
    if fast is not None:
        assert not isinstance(full, c.WireError), f"fast path accepted a refused buffer: {full}"
        assert _same(fast, full), (fast, full)
    try:
        got = c.decode_token_chunk(buf)
    except c.WireError as e:
        assert isinstance(full, c.WireError) and str(e) == str(full), (e, full)
    else:
        assert not isinstance(full, c.WireError) and _same(got, full), (got, full)
    if isinstance(full, c.WireError):
        return "WireError"
    return "fast" if fast is not None else "verified"


def run(
    inputs: int, seed: int = 1, crashes: Path | None = None, chunks: bool = False
) -> Counter[str]:
    """Mutate SEEDS through `check`, or with `chunks` only CHUNK_SEEDS through `check_chunk`
    (most such inputs stay close to the fixed layout, where the fast path has to decide)."""
    rng = random.Random(seed)
    seeds, probe = (CHUNK_SEEDS, check_chunk) if chunks else (SEEDS, check)
    seen: Counter[str] = Counter()
    for i in range(inputs):
        buf = mutate(rng, rng.choice(seeds))
        try:
            seen[probe(buf)] += 1
        except Exception as e:
            if crashes is not None:
                crashes.mkdir(parents=True, exist_ok=True)
                (crashes / f"crash-{seed}-{i}.bin").write_bytes(buf)
            raise AssertionError(f"input {i} (seed {seed}): {type(e).__name__}: {e}") from e
    return seen


def measure(shape: str) -> int:
    buf = aliased(shape)
    before = resource.getrusage(resource.RUSAGE_SELF)
    try:
        outcome = check(buf)
    except Exception as e:  # what the codec must never do: reported, not raised
        outcome = f"{type(e).__name__} (not WireError)"
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(
        f"{shape}: {len(buf)} bytes -> {outcome}; {cpu:.2f} CPU s, "
        f"peak RSS {after.ru_maxrss / 1024:.0f} MiB"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inputs", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--crashes", type=Path, default=Path("fuzz-crashes"))
    p.add_argument(
        "--chunks", action="store_true", help="only token chunks: the fast path vs the verifier"
    )
    p.add_argument(
        "--aliased",
        choices=ALIASED,
        help="instead: decode one 1 MiB aliased request; print the outcome, CPU s, peak RSS",
    )
    a = p.parse_args(argv)
    if a.aliased:
        return measure(a.aliased)
    t0 = time.monotonic()
    try:
        seen = run(a.inputs, a.seed, a.crashes, a.chunks)
    except AssertionError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    dt = time.monotonic() - t0
    print(f"{a.inputs} inputs in {dt:.1f} s ({a.inputs / dt:.0f}/s), seed {a.seed}: {dict(seen)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

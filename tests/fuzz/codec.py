"""Long-run fuzzing of the runtime's FlatBuffers decoding (what `meshlm serve` runs on every
request): structure-aware mutations of valid buffers, seeded and reproducible.

    .venv/bin/python -m tests.fuzz.codec --inputs 100000 [--seed 1]

Property, for every input: the decoders either raise `WireError` (the runtime answers
INVALID_ARGUMENT with its message) or return a message that passes every value check. Any
other exception is a bug; the input is written to `--crashes` and the run fails.
The default test run covers the same property with a bounded count (tests/test_fuzz_codec.py).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import struct
import sys
import time
from collections import Counter
from pathlib import Path

from schemas import codec as c

LIMITS = c.Limits(context_length=2048, vocab_size=49152)

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
    c.encode_token_chunk("r", 2, [17, 18], " Paris", None, 10, 20),
    c.encode_token_chunk("r", 3, [], "", "error", 0, None, c.ErrorInfo(13, "boom", "x")),
    c.encode_info_request(),
]
HOSTILE_U32 = [0, 1, 2, 3, 4, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFC, 0x10000, 0xFFFF]


def mutate(rng: random.Random, buf: bytes) -> bytes:
    """One to four stacked mutations of `buf`."""
    b = bytearray(buf)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(9)
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
    for decode in (c.decode_token_chunk, c.decode_model_info, c.decode_info_request):
        with contextlib.suppress(c.WireError):
            decode(buf)
    return outcome


def run(inputs: int, seed: int = 1, crashes: Path | None = None) -> Counter[str]:
    rng = random.Random(seed)
    seen: Counter[str] = Counter()
    for i in range(inputs):
        buf = mutate(rng, rng.choice(SEEDS))
        try:
            seen[check(buf)] += 1
        except Exception as e:
            if crashes is not None:
                crashes.mkdir(parents=True, exist_ok=True)
                (crashes / f"crash-{seed}-{i}.bin").write_bytes(buf)
            raise AssertionError(f"input {i} (seed {seed}): {type(e).__name__}: {e}") from e
    return seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inputs", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--crashes", type=Path, default=Path("fuzz-crashes"))
    a = p.parse_args(argv)
    t0 = time.monotonic()
    try:
        seen = run(a.inputs, a.seed, a.crashes)
    except AssertionError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    dt = time.monotonic() - t0
    print(f"{a.inputs} inputs in {dt:.1f} s ({a.inputs / dt:.0f}/s), seed {a.seed}: {dict(seen)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

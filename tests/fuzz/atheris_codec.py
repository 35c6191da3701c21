"""Coverage-guided fuzzing of the FlatBuffers decoders with atheris (optional extra `fuzz`).

    .venv/bin/pip install -e '.[fuzz]'
    .venv/bin/python tests/fuzz/atheris_codec.py -atheris_runs=100000 [-max_len=4096]

Same property as tests/fuzz/codec.py: WireError or a valid message, nothing else, and the token
chunk fast path answers as the verifier does. Its SEEDS, which the XOR below starts from, include
the shared-offset shapes of `aliased()` (issue 9) and chunks in the server's fixed layout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `tests`

with atheris.instrument_imports():
    from schemas import codec  # noqa: F401  (instrumented for coverage)
    from tests.fuzz.codec import SEEDS, check


def test_one_input(data: bytes) -> None:
    check(data)
    if len(data) >= 3:
        # Also XOR the input over a valid buffer (picked and positioned by its first bytes), so
        # coverage reaches past the verifier's first checks into the tables and vectors.
        base = bytearray(SEEDS[data[0] % len(SEEDS)])
        at = data[1] % len(base)
        for i, x in enumerate(data[2:]):
            base[(at + i) % len(base)] ^= x
        check(bytes(base))


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()

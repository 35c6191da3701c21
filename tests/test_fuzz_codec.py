"""A bounded run of the structure-aware codec fuzzer (tests/fuzz/codec.py): splices, aliased
regions, hostile vtable entries and lengths stacked on valid buffers of every message type.
tests/test_schemas_fuzz.py covers single random bytes/truncations/flips/offsets with hypothesis;
the long run is `python -m tests.fuzz.codec --inputs 100000` (MESHLM_FUZZ_INPUTS here)."""

from __future__ import annotations

import os

import pytest

from tests.fuzz import codec as fuzz

INPUTS = int(os.environ.get("MESHLM_FUZZ_INPUTS", "4000"))


@pytest.mark.parametrize("seed", [1, 2])
def test_mutated_buffers_decode_or_raise_wire_error(seed: int) -> None:
    seen = fuzz.run(INPUTS // 2, seed=seed)
    # Both outcomes occur: the mutations reach valid messages and hostile ones.
    assert seen["WireError"] > 0 and seen["accepted"] > 0, seen


def test_seeds_are_valid_messages() -> None:
    for buf in fuzz.SEEDS[:3]:
        assert fuzz.check(buf) == "accepted"

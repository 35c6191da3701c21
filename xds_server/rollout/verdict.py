"""The outcome of one analysis interval: PASS, FAIL or HALT (neither promotes nor counts as a
failure), with the reason and what was measured."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

PASS, FAIL, HALT = "pass", "fail", "halt"


@dataclass
class Verdict:
    outcome: str  # PASS, FAIL or HALT (halt: neither promotes nor counts as a failure)
    reason: str
    measurements: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

"""The rollout spec's typed field readers, shared by the spec and its quality gate: each error
names the field path (`RolloutSpecError`)."""

from __future__ import annotations

import re
from typing import Any


class RolloutSpecError(ValueError):
    pass


DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*\Z")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: Any, field_name: str) -> float:
    """'800ms', '10s', '1m', or a number of seconds -> seconds."""
    if isinstance(value, bool):
        raise RolloutSpecError(f"{field_name}: expected a duration like '10s', got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = DURATION.match(str(value))
        if not m:
            raise RolloutSpecError(f"{field_name}: expected a duration like '10s', got {value!r}")
        seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if seconds < 0:
        raise RolloutSpecError(f"{field_name}: must not be negative, got {value!r}")
    return seconds


def only_known(d: dict[str, Any], where: str, known: set[str], what: str = "field") -> None:
    """Refuse a key of `d` outside `known`, naming it and the known ones."""
    for k in d:
        if k not in known:
            raise RolloutSpecError(
                f"{where}.{k}: unknown {what} (known: {', '.join(sorted(known))})"
            )


def name(d: dict[str, Any], key: str, where: str) -> str:
    """`d[key]` as a non-empty string."""
    v = d.get(key)
    if not isinstance(v, str) or not v:
        raise RolloutSpecError(f"{where}.{key}: expected a non-empty name, got {v!r}")
    return v


def integer(v: Any, where: str, lo: int, hi: int | None = None) -> int:
    """An int (not a bool) within lo..hi (hi None: no upper bound)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise RolloutSpecError(f"{where}: expected an integer {rng}, got {v!r}")
    return v

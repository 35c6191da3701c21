"""The control plane's token budget service, as runtimes call it (`rate_limits.mode: global`).

gRPC `meshlm.budget.v1.TokenBudgets`, JSON messages (two small calls per generation; no schema
to generate). A runtime reaches it through its own sidecar's loopback budget listener, which
forwards to the control plane over the sidecar's `xds_cluster` (mTLS where the mesh has
identity), so the control plane sees the sidecar's workload certificate:

    Reserve {"service", "tenant", "tokens"} -> {"id"} | {"refused", "retry_after_s"}
    Settle  {"id", "used"}                  -> {}

A reservation that is never settled (its runtime died mid-stream) stays charged.
"""

from __future__ import annotations

import json
from typing import Any

SERVICE = "meshlm.budget.v1.TokenBudgets"
RESERVE = "Reserve"
SETTLE = "Settle"
PATH_PREFIX = f"/{SERVICE}/"
MAX_MESSAGE = 1024  # both messages are a few short fields


class WireError(ValueError):
    """A message that is not one of this service's; the message names the field."""


def encode(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def decode(raw: bytes, *shapes: dict[str, type]) -> dict[str, Any]:
    """A JSON object with exactly the fields of one of `shapes` ({name: type}); WireError
    names what is wrong."""
    if len(raw) > MAX_MESSAGE:
        raise WireError(f"message: {len(raw)} bytes, at most {MAX_MESSAGE}")
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError(f"message: not JSON ({e})") from None
    fields = next((f for f in shapes if isinstance(doc, dict) and set(doc) == set(f)), None)
    if fields is None:
        raise WireError(
            f"message: expected the fields {' or '.join(map(str, map(sorted, shapes)))}"
        )
    for name, kind in fields.items():
        v = doc[name]
        if not isinstance(v, kind) or isinstance(v, bool):
            raise WireError(f"{name}: expected {kind.__name__}, got {v!r}")
        if kind is int and v < 0:
            raise WireError(f"{name}: must be at least 0, got {v}")
    return doc


RESERVE_FIELDS: dict[str, type] = {"service": str, "tenant": str, "tokens": int}
SETTLE_FIELDS: dict[str, type] = {"id": str, "used": int}
RESERVED_FIELDS: dict[str, type] = {"id": str}
# retry_after_s 0: the call never fits (its reservation is larger than the whole budget).
REFUSED_FIELDS: dict[str, type] = {"refused": str, "retry_after_s": int}

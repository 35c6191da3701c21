"""One registration as a JSON record, as it is kept outside the process (the state dir's
registrations file, a key of the shared store), and read back: checked like a registration
message against the live mesh (request.parse), since whoever can write the file or the store
could write anything there."""

from __future__ import annotations

import json
import math
from typing import Any

from mesh_common import registry_wire as wire
from xds_server import mesh as m
from xds_server.registry import request as rq
from xds_server.registry.request import Refused
from xds_server.registry.table import Entry

FIELDS = {"node_id", "address", "service", "version", "zone", "weight", "health"}
EXTRA = {"spiffe_id", "since", "lost_at", "replica"}


def to_record(entry: Entry, replica: str | None = None) -> dict[str, Any]:
    """What is kept of `entry` (its stream's token is this process's, so not kept)."""
    r = entry.reg
    doc: dict[str, Any] = {
        "node_id": r.node_id,
        "address": str(r.endpoint),
        "service": r.service,
        "version": r.version,
        "health": wire.SERVING if entry.healthy else wire.NOT_SERVING,
        "spiffe_id": entry.spiffe_id,
        "since": entry.since,
        "lost_at": entry.lost_at,
    }
    if r.zone is not None:
        doc["zone"] = r.zone
    if r.weight is not None:
        doc["weight"] = r.weight
    if replica is not None:
        doc["replica"] = replica
    return doc


def from_record(doc: Any, mesh: m.Mesh, token: int, where: str) -> Entry:
    """The entry a record holds, for the stream `token`; ValueError naming `where` and the
    field when it is not one (or no longer fits the mesh: an unknown service or version)."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected an object")
    unknown = set(doc) - FIELDS - EXTRA
    if unknown:
        raise ValueError(f"{where}.{sorted(unknown)[0]}: unknown field")
    body = {k: v for k, v in doc.items() if k in FIELDS}
    try:
        reg = rq.parse(json.dumps({"register": body}).encode(), mesh)
    except Refused as e:
        raise ValueError(f"{where}: {e.message}") from None
    assert isinstance(reg, rq.Register)
    spiffe_id = doc.get("spiffe_id")
    if spiffe_id is not None and (not isinstance(spiffe_id, str) or len(spiffe_id) > 2048):
        raise ValueError(f"{where}.spiffe_id: expected a SPIFFE ID or null")
    since = _time(doc.get("since"), f"{where}.since")
    lost_at = doc.get("lost_at")
    if lost_at is not None:
        lost_at = _time(lost_at, f"{where}.lost_at")
    return Entry(token, reg, spiffe_id, since, reg.serving, lost_at)


def _time(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}: expected unix seconds, got {value!r:.40}")
    return float(value)

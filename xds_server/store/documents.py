"""Documents read from the store, checked like an admin request before anything uses them.

Whoever can write the store can write anything under its prefix, so a replica trusts no value:
each is parsed with bounds (size, nesting) and checked field by field; a bad one is refused
with a MeshError that names its key and field, and the caller keeps what it had.
"""

from __future__ import annotations

from typing import Any

from xds_server import mesh as m
from xds_server.mesh.faults import Fault, fault_from_doc, with_fault

LIVE_FIELDS = {"weights", "pins", "mirror", "endpoints", "slo_state"}


def mesh_source(doc: Any, key: str) -> Any:
    """The mesh document of `mesh`: {"source": the mesh file's data}; checked by parse_mesh."""
    if not isinstance(doc, dict) or "source" not in doc:
        raise m.MeshError(f"{key}: expected an object with a source, got {_kind(doc)}")
    return doc["source"]


def check_faults(doc: Any, key: str) -> list[Any]:
    """The shape of the `faults` document; each fault is checked where it is applied
    (faults_of), against the services of the mesh it is laid over."""
    if not isinstance(doc, dict) or set(doc) != {"faults"} or not isinstance(doc["faults"], list):
        raise m.MeshError(f"{key}: expected {{faults: [...]}}, got {_kind(doc)}")
    return doc["faults"]


def faults_of(
    doc: Any, key: str, services: dict[str, Any]
) -> tuple[dict[str, Fault], dict[str, str]]:
    """The faults of a checked `faults` document that `services` can take, and those refused:
    name -> why (a fault whose host or version left is refused alone, not with the others)."""
    out: dict[str, Fault] = {}
    refused: dict[str, str] = {}
    for n, item in enumerate(check_faults(doc, key)):
        try:
            fault = fault_from_doc(item, services)
            out = with_fault(out, fault)
        except m.MeshError as e:
            name = item.get("name") if isinstance(item, dict) else None
            refused[str(name) if isinstance(name, str) else f"[{n}]"] = f"{key}: {e}"
    return out, refused


def check_live(doc: Any, key: str) -> dict[str, Any]:
    """The shape of a `live/<service>` document (what replica.live_doc writes); the values are
    checked where they are applied (Mesh.with_weights and the rest)."""
    if not isinstance(doc, dict):
        raise m.MeshError(f"{key}: expected an object, got {_kind(doc)}")
    unknown = set(doc) - LIVE_FIELDS
    if unknown:
        raise m.MeshError(f"{key}.{sorted(unknown)[0]}: unknown field")
    for field in ("weights", "endpoints"):
        if field not in doc:
            raise m.MeshError(f"{key}.{field}: missing")
    _mapping_of(doc["weights"], f"{key}.weights", lambda v: isinstance(v, int) and not _bool(v))
    _mapping_of(doc["endpoints"], f"{key}.endpoints", _strings)
    pins = doc.get("pins")
    if pins is not None and not (isinstance(pins, list) and len(pins) == 2 and _strings(pins)):
        raise m.MeshError(f"{key}.pins: expected [stable, canary] or null, got {pins!r:.80}")
    mirror = doc.get("mirror")
    if mirror is not None:
        if not isinstance(mirror, dict) or set(mirror) != {"version", "percent"}:
            raise m.MeshError(f"{key}.mirror: expected {{version, percent}} or null")
        if not isinstance(mirror["version"], str):
            raise m.MeshError(f"{key}.mirror.version: expected a string")
        if _bool(mirror["percent"]) or not isinstance(mirror["percent"], int | float):
            raise m.MeshError(f"{key}.mirror.percent: expected a number")
    slo = doc.get("slo_state")
    if slo is not None:
        if not isinstance(slo, dict) or not set(slo) <= {"shed_tenants", "outlier_tightened"}:
            raise m.MeshError(
                f"{key}.slo_state: expected {{shed_tenants, outlier_tightened}} or null, "
                f"got {_kind(slo)}"
            )
        shed = slo.get("shed_tenants")
        if shed is not None and not (isinstance(shed, list) and _strings(shed)):
            raise m.MeshError(f"{key}.slo_state.shed_tenants: expected a list of tenant names")
        if not isinstance(slo.get("outlier_tightened", False), bool):
            raise m.MeshError(f"{key}.slo_state.outlier_tightened: expected true or false")
    return doc


def _mapping_of(value: Any, path: str, ok: Any) -> None:
    if not isinstance(value, dict):
        raise m.MeshError(f"{path}: expected an object, got {_kind(value)}")
    for k, v in value.items():
        if not ok(v):
            raise m.MeshError(f"{path}.{k}: unexpected value {v!r:.80}")


def _strings(items: Any) -> bool:
    return isinstance(items, list) and all(isinstance(i, str) for i in items)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _kind(v: Any) -> str:
    return type(v).__name__ if not isinstance(v, dict) else "an object"

"""The mesh file's `control_plane.registration:` section: whether workloads may register their
own endpoints, how long a vanished one stays, how many the control plane keeps, and whether the
mesh spans hosts."""

from __future__ import annotations

from typing import Any

from xds_server.mesh.fields import MeshError, only_known, parse_duration, read_int, read_mapping
from xds_server.mesh.model import Registration

PATH = "control_plane.registration"
MAX_GRACE = 3600.0
MAX_REGISTRATIONS = 100_000


def parse_registration(raw: Any) -> Registration:
    """`{enabled, grace, max_per_service, max_total, multi_host}`, all optional."""
    d = read_mapping(raw, PATH)
    only_known(d, PATH, {"enabled", "grace", "max_per_service", "max_total", "multi_host"})
    for key in ("enabled", "multi_host"):
        if d.get(key) is not None and not isinstance(d[key], bool):
            raise MeshError(f"{PATH}.{key}: expected true or false, got {d[key]!r}")
    grace = parse_duration(d.get("grace", "10s"), f"{PATH}.grace")
    if grace > MAX_GRACE:
        raise MeshError(f"{PATH}.grace: at most {MAX_GRACE:g}s, got {grace:g}s")
    per_service = read_int(
        d.get("max_per_service", 64), f"{PATH}.max_per_service", 1, MAX_REGISTRATIONS
    )
    total = read_int(d.get("max_total", 1024), f"{PATH}.max_total", 1, MAX_REGISTRATIONS)
    return Registration(
        enabled=d.get("enabled"),
        grace=grace,
        max_per_service=per_service,
        max_total=total,
        multi_host=bool(d.get("multi_host")),
    )

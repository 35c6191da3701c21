"""A service's `locality`: which zones a caller's calls go to first (Istio's localityLbSetting)."""

from __future__ import annotations

from dataclasses import dataclass

from xds_server.mesh.fields import MeshError, check_name, only_known


@dataclass(frozen=True)
class Locality:
    """A caller keeps its calls in its own zone, then fails over in `failover` order, then to
    every other zone (hosts without a zone last). A zone named here need not have hosts yet:
    zones arrive with registrations."""

    failover: tuple[str, ...] = ()


def parse_locality(d: dict, path: str) -> Locality:
    only_known(d, path, {"failover"})
    raw = d.get("failover", [])
    if not isinstance(raw, list):
        raise MeshError(f"{path}.failover: expected a list of zones, got {type(raw).__name__}")
    zones: list[str] = []
    for i, z in enumerate(raw):
        where = f"{path}.failover[{i}]"
        if not isinstance(z, str) or not z:
            raise MeshError(f"{where}: expected a zone name, got {z!r}")
        check_name(z, where)
        if z in zones:
            raise MeshError(f"{where}: duplicate zone {z!r}")
        zones.append(z)
    return Locality(failover=tuple(zones))


def priorities(
    zones: set[str], caller_zone: str | None, locality: Locality | None
) -> dict[str, int]:
    """Zone -> Envoy priority for one caller: its own zone 0, then `failover` order, then the
    other zones by name, then the hosts without a zone (""). Priorities are contiguous, as
    Envoy requires. Without a caller zone or a `locality`, every zone is priority 0."""
    if locality is None or not caller_zone:
        return dict.fromkeys(zones, 0)
    named = [caller_zone, *(z for z in locality.failover if z != caller_zone)]
    order = [z for z in named if z in zones]
    order += sorted(z for z in zones if z and z not in order)
    if "" in zones:
        order.append("")
    return {z: i for i, z in enumerate(order)}

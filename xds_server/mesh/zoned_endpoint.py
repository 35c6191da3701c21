"""A version's static endpoint with the zone (locality) it is in."""

from __future__ import annotations

import dataclasses
from typing import Any

from xds_server.mesh.fields import MeshError, check_name, only_known, read_mapping
from xds_server.mesh.model import Endpoint, parse_endpoint


def parse_zoned_endpoint(raw: Any, path: str) -> Endpoint:
    """A version's static endpoint: `host:port`, or `{address: host:port, zone: Z}`."""
    if not isinstance(raw, dict):
        return parse_endpoint(raw, path)
    d = read_mapping(raw, path)
    only_known(d, path, {"address", "zone"})
    ep = parse_endpoint(d.get("address"), f"{path}.address")
    zone = d.get("zone")
    if zone is None:
        return ep
    if not isinstance(zone, str) or not zone:
        raise MeshError(f"{path}.zone: expected a zone name, got {zone!r}")
    check_name(zone, f"{path}.zone")
    return dataclasses.replace(ep, zone=zone)

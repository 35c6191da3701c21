"""One message of a registration stream (mesh_common/registry_wire.py), read and checked against
the live mesh: every refusal is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass

import grpc

from mesh_common import registry_wire as wire
from xds_server import mesh as m

NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}\Z")
ZONE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")
MAX_WEIGHT = 128  # Envoy's load_balancing_weight is 1 or more; a small range keeps it sane


class Refused(Exception):
    """A registration message or stream the control plane refuses: a gRPC status and a message
    that names the field (never a key)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _bad(message: str) -> Refused:
    return Refused(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class Register:
    node_id: str
    endpoint: m.Endpoint
    service: str
    version: str
    zone: str | None = None
    weight: int | None = None
    serving: bool = True


@dataclass(frozen=True)
class Health:
    serving: bool


@dataclass(frozen=True)
class Deregister:
    pass


Message = Register | Health | Deregister


def parse(raw: bytes, mesh: m.Mesh) -> Message:
    """`raw` as one message of the stream; Refused naming the field otherwise."""
    if len(raw) > wire.MAX_MESSAGE:
        raise _bad(f"message: {len(raw)} bytes, at most {wire.MAX_MESSAGE}")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise _bad("message: expected a JSON object") from None
    if not isinstance(doc, dict) or len(doc) != 1:
        raise _bad("message: expected one of {register: {...}}, {health: ...}, {deregister: {}}")
    ((kind, body),) = doc.items()
    if kind == "register":
        return _register(body, mesh)
    if kind == "health":
        return Health(_serving(body, "health"))
    if kind == "deregister":
        if body not in ({}, None):
            raise _bad("deregister: expected {}")
        return Deregister()
    raise _bad(f"message.{m.field_name(kind)}: unknown (allowed: register, health, deregister)")


def claimed_node(raw: bytes) -> str:
    """The node id a message that did not parse as a whole claims, for the log line of its
    refusal ("" where it names none, or none that is a node id)."""
    if len(raw) > wire.MAX_MESSAGE:
        return ""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return ""
    body = doc.get("register") if isinstance(doc, dict) else None
    node = body.get("node_id") if isinstance(body, dict) else None
    return node if isinstance(node, str) and NODE_ID.match(node) else ""


def _serving(value: object, path: str) -> bool:
    if value not in wire.HEALTH:
        raise _bad(f"{path}: expected {' or '.join(wire.HEALTH)}, got {value!r}")
    return value == wire.SERVING


def _register(body: object, mesh: m.Mesh) -> Register:
    if not isinstance(body, dict):
        raise _bad("register: expected an object")
    for k in body:
        if k not in wire.REGISTER_FIELDS:
            raise _bad(
                f"register.{m.field_name(k)}: unknown field "
                f"(allowed: {', '.join(wire.REGISTER_FIELDS)})"
            )
    node_id = body.get("node_id")
    if not isinstance(node_id, str) or not NODE_ID.match(node_id):
        raise _bad(
            f"register.node_id: expected 1 to 128 letters, digits, . _ : @ -, got {node_id!r}"
        )
    endpoint = _address(body.get("address"), mesh.control_plane.registration.multi_host)
    service = body.get("service")
    svc = mesh.services.get(service) if isinstance(service, str) else None
    if svc is None:
        raise _bad(
            f"register.service: unknown service {service!r} (known: {', '.join(mesh.services)})"
        )
    version = body.get("version")
    if not isinstance(version, str) or version not in svc.versions:
        raise _bad(
            f"register.version: unknown version {version!r} of {svc.name} "
            f"(known: {', '.join(svc.versions)})"
        )
    zone = body.get("zone")
    if zone is not None and (not isinstance(zone, str) or not ZONE.match(zone)):
        raise _bad(f"register.zone: expected 1 to 63 letters, digits, . _ -, got {zone!r}")
    weight = body.get("weight")
    if weight is not None and (
        isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= MAX_WEIGHT
    ):
        raise _bad(f"register.weight: expected an integer 1..{MAX_WEIGHT}, got {weight!r}")
    serving = _serving(body.get("health", wire.SERVING), "register.health")
    return Register(node_id, endpoint, svc.name, version, zone, weight, serving)


def _address(raw: object, multi_host: bool) -> m.Endpoint:
    try:
        endpoint = m.parse_endpoint(raw, "register.address")
    except m.MeshError as e:
        raise _bad(str(e)) from None
    ip = ipaddress.IPv4Address(endpoint.host)
    if ip.is_unspecified or ip.is_multicast:
        raise _bad(f"register.address: {endpoint.host} is not an address callers can reach")
    if multi_host and ip.is_loopback:
        raise _bad(
            f"register.address: {endpoint} is loopback, and the mesh spans hosts "
            "(control_plane.registration.multi_host): register an address other hosts reach"
        )
    return endpoint

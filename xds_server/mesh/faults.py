"""The mesh file's `faults:` block: delays and aborts injected into the calls a policy names (a
service, optionally one version and a request header), as Envoy's HTTP fault filter
(envoy.filters.http.fault) does them. The caller sidecars inject a service's fault; a fault
that names a `host` (one endpoint of the service) is injected by that host's own inbound
sidecar, so every caller sees that one host slow or failing."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from xds_server.mesh.fields import (
    MeshError,
    check_name,
    only_known,
    parse_duration,
    read_int,
    read_mapping,
)
from xds_server.mesh.model import parse_endpoint

# google.rpc.Code: OK (0) is no abort.
GRPC_STATUS_RANGE = (1, 16)
HTTP_STATUS_RANGE = (200, 599)


@dataclass(frozen=True)
class FaultDelay:
    fixed_delay: float  # seconds
    percent: float = 100.0


@dataclass(frozen=True)
class FaultAbort:
    http_status: int | None = None
    grpc_status: int | None = None
    percent: float = 100.0


@dataclass(frozen=True)
class Fault:
    """One named fault: the calls to `service` (only those bound to `version`, and only those
    carrying `header` = `header_value` where set) get `delay` and/or `abort`."""

    name: str
    service: str
    version: str | None = None
    header: str | None = None
    header_value: str | None = None
    delay: FaultDelay | None = None
    abort: FaultAbort | None = None
    # Wall-clock time (epoch seconds) the control plane removes it at; None: until removed.
    expires_at: float | None = None
    # `ip:port` of one endpoint of `service`: only the calls that host serves, injected by its
    # inbound sidecar. None: every call to the service, injected by the callers.
    host: str | None = None
    # Set over the admin API (`meshlm fault`), not by the mesh file: a new mesh file keeps it.
    at_run_time: bool = False

    @property
    def scope(self) -> tuple[str, str | None]:
        """What one fault at most may hold: a service's callers, or one host of it."""
        return self.service, self.host


def parse_faults(raw: Any, services: dict[str, Any]) -> dict[str, Fault]:
    """`faults:` -> {name: Fault}; MeshError names the bad field."""
    out: dict[str, Fault] = {}
    for name, spec in read_mapping(raw, "faults").items():
        path = f"faults.{name}"
        check_name(name, path)
        out = with_fault(out, parse_fault(name, spec, services, path))
    return out


def parse_fault(name: str, raw: Any, services: dict[str, Any], path: str) -> Fault:
    d = read_mapping(raw, path)
    only_known(d, path, {"service", "version", "host", "headers", "delay", "abort"})
    service = d.get("service")
    if not isinstance(service, str) or service not in services:
        raise MeshError(
            f"{path}.service: unknown service {service!r} (known: {', '.join(services)})"
        )
    version = d.get("version")
    if version is not None and (
        not isinstance(version, str) or version not in services[service].versions
    ):
        known = ", ".join(services[service].versions)
        raise MeshError(f"{path}.version: unknown version {version!r} of {service} ({known})")
    host = _host(d.get("host"), services[service], version, f"{path}.host")
    header, value = _header(d.get("headers"), f"{path}.headers")
    delay = _delay(d["delay"], f"{path}.delay") if d.get("delay") is not None else None
    abort = _abort(d["abort"], f"{path}.abort") if d.get("abort") is not None else None
    if delay is None and abort is None:
        raise MeshError(f"{path}: needs a delay or an abort (or both)")
    return Fault(name, service, version, header, value, delay, abort, host=host)


def host_versions(svc: Any) -> dict[str, list[str]]:
    """`ip:port` -> the versions of `svc` it serves: static endpoints and registered hosts."""
    out: dict[str, list[str]] = {}
    for v, ver in svc.versions.items():
        for e in (*ver.endpoints, *(r.endpoint for r in ver.registered)):
            out.setdefault(str(e), []).append(v)
    return out


def _host(raw: Any, svc: Any, version: str | None, path: str) -> str | None:
    if raw is None:
        return None
    host = str(parse_endpoint(raw, path))
    served = host_versions(svc)
    if host not in served:
        known = ", ".join(served) or "none"
        raise MeshError(f"{path}: {host} is no endpoint of {svc.name} (its endpoints: {known})")
    if version is not None and version not in served[host]:
        raise MeshError(
            f"{path}: {host} does not serve {svc.name}/{version} "
            f"(it serves {', '.join(served[host])})"
        )
    return host


def _header(raw: Any, path: str) -> tuple[str | None, str | None]:
    d = read_mapping(raw, path)
    if not d:
        return None, None
    if len(d) != 1:
        raise MeshError(f"{path}: one header name: value, got {len(d)}")
    ((key, value),) = d.items()
    if not key or key != key.lower() or key.startswith(":") or not isinstance(value, str):
        raise MeshError(f"{path}.{key}: expected a lower-case header name and a string value")
    return key, value


def _percent(d: dict, path: str) -> float:
    v = d.get("percent", 100)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 100:
        raise MeshError(f"{path}.percent: expected a number in (0, 100], got {v!r}")
    return float(v)


def _delay(raw: Any, path: str) -> FaultDelay:
    d = read_mapping(raw, path)
    only_known(d, path, {"fixed_delay", "percent"})
    if d.get("fixed_delay") is None:
        raise MeshError(f"{path}.fixed_delay: required (a duration like 500ms)")
    fixed = parse_duration(d["fixed_delay"], f"{path}.fixed_delay")
    if fixed <= 0:
        raise MeshError(f"{path}.fixed_delay: must be greater than 0")
    return FaultDelay(fixed, _percent(d, path))


def _abort(raw: Any, path: str) -> FaultAbort:
    d = read_mapping(raw, path)
    only_known(d, path, {"http_status", "grpc_status", "percent"})
    http, grpc_ = d.get("http_status"), d.get("grpc_status")
    if (http is None) == (grpc_ is None):
        raise MeshError(f"{path}: exactly one of http_status, grpc_status")
    if http is not None:
        read_int(http, f"{path}.http_status", *HTTP_STATUS_RANGE)
    if grpc_ is not None:
        read_int(grpc_, f"{path}.grpc_status", *GRPC_STATUS_RANGE)
    return FaultAbort(http, grpc_, _percent(d, path))


def with_fault(faults: dict[str, Fault], fault: Fault) -> dict[str, Fault]:
    """`faults` with `fault` added or replaced (by name); MeshError when another fault already
    holds its scope: one fault per service on its callers (a virtual host carries one fault
    config) and one per host of it."""
    for other in faults.values():
        if other.name != fault.name and other.scope == fault.scope:
            field, what = ("host", fault.host) if fault.host else ("service", fault.service)
            raise MeshError(
                f"faults.{fault.name}.{field}: {what} already has fault {other.name} "
                f"(one fault per {field}; remove it first)"
            )
    return {**faults, fault.name: fault}


def fault_doc(fault: Fault) -> dict[str, Any]:
    """A fault as the admin API lists it (the mesh file's field names)."""
    doc: dict[str, Any] = {"name": fault.name, "service": fault.service}
    if fault.version is not None:
        doc["version"] = fault.version
    if fault.host is not None:
        doc["host"] = fault.host
    if fault.header is not None:
        doc["headers"] = {fault.header: fault.header_value}
    if fault.delay is not None:
        doc["delay"] = {
            "fixed_delay": f"{fault.delay.fixed_delay:g}s",
            "percent": fault.delay.percent,
        }
    if fault.abort is not None:
        a = fault.abort
        status = {"http_status": a.http_status} if a.http_status else {"grpc_status": a.grpc_status}
        doc["abort"] = {**status, "percent": a.percent}
    doc["expires_at"] = fault.expires_at
    doc["at_run_time"] = fault.at_run_time
    return doc


def fault_from_doc(doc: Any, services: dict[str, Any]) -> Fault:
    """A fault as fault_doc wrote it (a faults file, the store's `faults` key), checked like a
    new one against `services`; MeshError names the field."""
    d = dict(read_mapping(doc, "faults[]"))
    name = d.pop("name", None)
    if not isinstance(name, str):
        raise MeshError(f"faults[].name: expected a string, got {name!r:.40}")
    path = f"faults.{name}"
    check_name(name, path)
    expires_at, at_run_time = d.pop("expires_at", None), d.pop("at_run_time", False)
    if expires_at is not None and (
        isinstance(expires_at, bool) or not isinstance(expires_at, int | float)
    ):
        raise MeshError(f"{path}.expires_at: expected epoch seconds or null")
    if not isinstance(at_run_time, bool):
        raise MeshError(f"{path}.at_run_time: expected true or false")
    fault = parse_fault(name, d, services, path)
    return replace(fault, expires_at=expires_at, at_run_time=at_run_time)


def carried_over(
    live: dict[str, Fault], faults: dict[str, Fault], services: dict[str, Any]
) -> tuple[dict[str, Fault], dict[str, str]]:
    """`faults` (a new mesh file's) with the run-time faults of `live` that it can still take;
    and those dropped, name -> why: the file names a fault the same, or gives its scope to
    one of its own (the file says what it wants there), or its service, version or host is
    gone."""
    out, dropped = dict(faults), {}
    for name, fault in live.items():
        if not fault.at_run_time:
            continue
        if name in faults:
            dropped[name] = f"faults.{name}: the mesh file defines a fault of that name"
            continue
        try:
            fault_from_doc(fault_doc(fault), services)  # its service, version, host still there
            out = with_fault(out, fault)
        except MeshError as e:
            dropped[name] = str(e)
    return out, dropped

"""The admin API's faults (`meshlm fault`): GET /v1/faults lists them, POST /v1/faults/NAME
adds or replaces one (the mesh file's fields, plus `duration`), DELETE /v1/faults/NAME removes
it; each change answers once the affected caller sidecars ACKed it. `FaultExpiry` removes a
fault when its duration ends, so no fault outlives the CLI that set it."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from xds_server.mesh.faults import Fault, fault_doc, parse_fault
from xds_server.mesh.fields import MeshError, check_name, parse_duration

log = logging.getLogger(__name__)

PREFIX = "/v1/faults"


def _outcome(r: Any, noop: dict[str, Any]) -> tuple[int, Any]:
    if r is None:
        return 200, {**noop, "changed": False}
    return (200 if r.ok else (409 if r.errors else 504)), r.to_json()


def handle(cp: Any, now: Any = time.time) -> Any:
    """The mount for PREFIX on the admin API (behind its token)."""

    def mount(method: str, target: str, body: bytes) -> tuple[int, Any]:
        url = urlsplit(target)
        parts = [unquote(p) for p in url.path.split("/") if p][2:]
        try:
            timeout = float(parse_qs(url.query).get("timeout", ["10"])[0])
        except ValueError:
            return 400, {"error": "timeout: expected seconds"}
        if method == "GET" and not parts:
            return 200, {"faults": [fault_doc(f) for f in cp.mesh.faults.values()]}
        if len(parts) != 1 or method not in ("POST", "DELETE"):
            return 404, {"error": f"no such endpoint: {method} {url.path}"}
        if cp.replication is not None:
            return 501, {"error": "faults over the admin API need a control plane without a store"}
        name = parts[0]
        if method == "DELETE":
            if name not in cp.mesh.faults:
                return 404, {"error": f"faults.{name}: no such fault"}
            return _outcome(cp.remove_fault(name, timeout=timeout), {"removed": name})
        try:
            fault = _fault(name, body, cp.mesh, now())
            return _outcome(cp.set_fault(fault, timeout=timeout), fault_doc(fault))
        except RecursionError:
            return 400, {"error": "bad request: JSON nested too deeply"}
        except ValueError as e:  # MeshError names the field; nothing was pushed
            return 400, {"error": str(e)}

    return mount


def _fault(name: str, body: bytes, mesh: Any, now: float) -> Fault:
    path = f"faults.{name}"
    check_name(name, path)
    doc = json.loads(body or b"{}")
    if not isinstance(doc, dict):
        raise MeshError(f"{path}: expected a JSON object")
    doc = dict(doc)
    duration = doc.pop("duration", None)
    fault = parse_fault(name, doc, mesh.services, path)
    if duration is None:
        return fault
    seconds = parse_duration(duration, f"{path}.duration")
    if seconds <= 0:
        raise MeshError(f"{path}.duration: must be greater than 0")
    return Fault(**{**fault.__dict__, "expires_at": now + seconds})


class FaultExpiry:
    """Removes each fault whose `expires_at` has passed, every `interval` seconds (the control
    plane's clock: a fault set with a duration ends even when no client is left)."""

    def __init__(self, cp: Any, interval: float = 0.5, now: Any = time.time) -> None:
        self.cp, self.interval, self.now = cp, interval, now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-expiry", daemon=True)

    def start(self) -> FaultExpiry:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.expire()
            except Exception:  # keep expiring the others on the next tick
                log.exception("fault expiry failed")

    def expire(self) -> None:
        now = self.now()
        for fault in list(self.cp.mesh.faults.values()):
            if fault.expires_at is not None and fault.expires_at <= now:
                r = self.cp.remove_fault(fault.name, timeout=10.0, only=fault)
                log.info("fault %s expired: removed (%s)", fault.name, r and r.version)

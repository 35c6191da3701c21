"""The admin API's faults (`meshlm fault`): GET /v1/faults lists them, POST /v1/faults/NAME
adds or replaces one (the mesh file's fields, plus `duration`), DELETE /v1/faults/NAME removes
it; each change answers once the affected caller sidecars ACKed it. `FaultExpiry` removes a
fault when its duration ends, so no fault outlives the CLI that set it."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from xds_server.mesh.faults import Fault, fault_doc, fault_from_doc, parse_fault
from xds_server.mesh.fields import MeshError, check_name, parse_duration

log = logging.getLogger(__name__)

PREFIX = "/v1/faults"


def _outcome(r: Any, noop: dict[str, Any]) -> tuple[int, Any]:
    if r is None:
        return 200, {**noop, "changed": False}
    return (200 if r.ok else (409 if r.errors else 504)), r.to_json()


def handle(cp: Any, now: Any = time.time, file: FaultFile | None = None) -> Any:
    """The mount for PREFIX on the admin API (behind its token); each change is saved to
    `file` once staged."""

    def saved(reply: tuple[int, Any]) -> tuple[int, Any]:
        if file is not None:
            file.save(cp.mesh.faults)
        return reply

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
        name = parts[0]
        if method == "DELETE":
            if name not in cp.mesh.faults:
                return 404, {"error": f"faults.{name}: no such fault"}
            return saved(_outcome(cp.remove_fault(name, timeout=timeout), {"removed": name}))
        try:
            fault = _fault(name, body, cp.mesh, now())
            return saved(_outcome(cp.set_fault(fault, timeout=timeout), fault_doc(fault)))
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
    fault = dataclasses.replace(fault, at_run_time=True)
    if duration is None:
        return fault
    seconds = parse_duration(duration, f"{path}.duration")
    if seconds <= 0:
        raise MeshError(f"{path}.duration: must be greater than 0")
    return dataclasses.replace(fault, expires_at=now + seconds)


# How long a restored fault that names no known host yet waits for hosts to register again
# (seconds after the restart) before it is dropped.
RESTORE_PATIENCE = 60.0


class FaultFile:
    """The live faults kept across a restart of the control plane (JSON, the admin API's
    listing); `expires_at` is wall-clock time, so one that ended while it was down stays gone."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.saved: list[dict[str, Any]] | None = None
        # Restored faults the mesh cannot take yet (a `host:` fault on a host that has not
        # registered again), retried until RESTORE_PATIENCE has passed; saved meanwhile.
        self.pending: list[dict[str, Any]] = []
        self.pending_until = 0.0

    def save(self, faults: dict[str, Fault]) -> None:
        docs = [fault_doc(f) for f in faults.values()]
        docs += [d for d in self.pending if d.get("name") not in faults]
        if docs == self.saved:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(docs))
        os.replace(tmp, self.path)
        self.saved = docs

    def restore(self, cp: Any, now: float, patience: float = RESTORE_PATIENCE) -> list[str]:
        """Stage the saved faults not yet ended; the names restored. One the mesh cannot take
        yet is retried (retry()) for `patience` seconds, then logged and dropped."""
        try:
            docs = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:  # the control plane still starts, without them
            log.warning("%s: faults not restored: %s", self.path, e)
            return []
        self.pending = [d for d in docs if isinstance(d, dict)] if isinstance(docs, list) else []
        self.pending_until = now + patience
        return self.retry(cp, now)

    def retry(self, cp: Any, now: float) -> list[str]:
        """Stage the pending faults the live mesh (registered hosts included) takes now; the
        names staged. A pending fault that ended, or that a newer one of its name replaced, is
        dropped."""
        restored, waiting = [], []
        for doc in self.pending:
            try:
                fault = fault_from_doc(doc, cp.mesh.services)
            except ValueError as e:
                if now < self.pending_until:
                    waiting.append(doc)
                else:
                    log.warning("%s: a fault not restored: %s", self.path, e)
                continue
            if fault.name in cp.mesh.faults or (
                fault.expires_at is not None and fault.expires_at <= now
            ):
                continue
            try:  # every fault saved here was set at run time
                cp.set_fault(dataclasses.replace(fault, at_run_time=True), timeout=0)
            except ValueError as e:  # its scope is taken meanwhile
                log.warning("%s: a fault not restored: %s", self.path, e)
                continue
            restored.append(fault.name)
        self.pending = waiting
        return restored


class FaultExpiry:
    """Removes each fault whose `expires_at` has passed, every `interval` seconds (the control
    plane's clock: a fault set with a duration ends even when no client is left), and keeps
    `file` (if any) equal to the live faults."""

    def __init__(
        self,
        cp: Any,
        interval: float = 0.5,
        now: Any = time.time,
        file: FaultFile | None = None,
    ) -> None:
        self.cp, self.interval, self.now, self.file = cp, interval, now, file
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
        if self.file is not None:
            if self.file.pending:
                for name in self.file.retry(self.cp, now):
                    log.info("fault %s restored", name)
            self.file.save(self.cp.mesh.faults)

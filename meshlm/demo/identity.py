"""What the demo's sidecars hold and use for workload identity, for its report.

Certificates as the sidecars' agents hold them (their credentials file, read for the public
certificate only: the key in it is never read into the report), watched while the demo runs, so
renewals and root rotations are seen as they happen; and what Envoy actually uses: the
certificate its admin `/certs` shows, and per hop whether TLS handshakes happened there (Envoy's
`ssl.handshake` counters), not what the mesh file asks for.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from cryptography import x509

from sidecar.identity import CREDENTIALS_FILE
from xds_server.identity.ca import spki_sha256, uri_sans


class CertWatch:
    """Polls each sidecar agent's certificate and trust bundle (every `interval` s)."""

    def __init__(self, identity_dirs: dict[str, Path], interval: float = 1.0) -> None:
        self.dirs = identity_dirs
        self.interval = interval
        self._serials: dict[str, list[str]] = {name: [] for name in identity_dirs}
        self._roots: dict[str, list[str]] = {name: [] for name in identity_dirs}
        self._current: dict[str, x509.Certificate] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cert-watch", daemon=True)

    def start(self) -> CertWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.poll()  # the last state, for the report

    def wait_all(self, timeout: float) -> dict[str, str]:
        """Each sidecar's SPIFFE ID once every agent holds a certificate."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            with self._lock:
                if len(self._current) == len(self.dirs):
                    return {name: _spiffe_id(c) for name, c in self._current.items()}
                missing = sorted(set(self.dirs) - set(self._current))
            if time.monotonic() > deadline:
                raise TimeoutError(f"no workload certificate after {timeout:g}s for {missing}")
            time.sleep(0.2)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        for name, d in self.dirs.items():
            try:
                doc = json.loads((d / CREDENTIALS_FILE).read_text())
                leaf = x509.load_pem_x509_certificate(doc["chain"][0].encode())
                roots = [
                    spki_sha256(x509.load_pem_x509_certificate(r.encode())) for r in doc["bundle"]
                ]
            except (OSError, ValueError, KeyError, TypeError, IndexError):
                continue  # not there yet, or being replaced
            with self._lock:
                self._current[name] = leaf
                serial = f"{leaf.serial_number:x}"
                if serial not in self._serials[name]:
                    self._serials[name].append(serial)
                for r in roots:
                    if r not in self._roots[name]:
                        self._roots[name].append(r)

    def summary(self, admin_ports: dict[str, int]) -> dict[str, dict[str, Any]]:
        """Per sidecar: its SPIFFE ID, certificate serial and expiry, renewals and root
        rotations seen, and whether its Envoy presents a certificate of this agent's."""
        self.poll()  # what the agents hold now, not a second ago
        in_envoy = {name: envoy_serials(port) for name, port in admin_ports.items()}
        self.poll()  # a renewal Envoy got while it was read
        out = {}
        with self._lock:
            for name in self.dirs:
                leaf = self._current.get(name)
                if leaf is None:
                    out[name] = {"spiffe_id": None}
                    continue
                serial = f"{leaf.serial_number:x}"
                out[name] = {
                    "spiffe_id": _spiffe_id(leaf),
                    "serial": serial,
                    "not_after": leaf.not_valid_after_utc.isoformat(),
                    "certificates_seen": len(self._serials[name]),
                    "renewals": len(self._serials[name]) - 1,
                    "root_rotations": max(0, len(self._roots[name]) - 1),
                    # Envoy presents one of them (a renewal reaches it by SDS a moment later).
                    "in_envoy": bool(in_envoy[name] & set(self._serials[name])),
                }
        return out


def _spiffe_id(cert: x509.Certificate) -> str:
    sans = uri_sans(cert)
    return sans[0] if sans else ""


def _admin_json(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return json.loads(r.read())


def envoy_serials(admin_port: int) -> set[str]:
    """Serial numbers (hex, lower case) of the certificates Envoy's TLS contexts present."""
    serials = set()
    for ctx in _admin_json(admin_port, "/certs").get("certificates", []):
        for c in ctx.get("cert_chain", []):
            serials.add(c.get("serial_number", "").lower().lstrip("0"))
    return serials


def handshakes(admin_port: int) -> dict[str, int]:
    """Envoy's `ssl.handshake` counters: `cluster.NAME` / `listener.ADDRESS` -> handshakes."""
    stats = _admin_json(admin_port, "/stats?format=json&filter=ssl%5C.handshake%24")["stats"]
    return {
        s["name"].removesuffix(".ssl.handshake"): s["value"]
        for s in stats
        if "value" in s and s["name"].endswith(".ssl.handshake")
    }

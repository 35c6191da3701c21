"""Whether each version a service's weights send traffic to can take it: one with no endpoint in the
mesh and no registered host cannot (the weights API refuses to send it traffic unless forced); one
whose registered hosts all answer NOT_SERVING, or whose endpoints answer no probe
(xds_server/rollout/liveness.py, as a rollout's preflight probes its canary), has no live sidecar
or runtime there now (a warning: it may be starting). A registered host that serves is live: its
health is what its sidecar reports. `GET /traffic` lists both for the live weights
(`meshlm status`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from xds_server.control_plane import ControlPlane
from xds_server.rollout.liveness import GrpcHealthSource, not_live_reason
from xds_server.rollout.sources import mtls_probe


@dataclass(frozen=True)
class Stranded:
    service: str
    version: str
    weight: int
    reason: str
    no_endpoint: bool  # none in the mesh at all (else: none answers)

    @property
    def message(self) -> str:
        return (
            f"traffic to {self.service}/{self.version} ({self.weight} %) has nowhere to go: "
            f"{self.reason}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "service": self.service,
            "version": self.version,
            "weight": self.weight,
            "no_endpoint": self.no_endpoint,
            "message": self.message,
        }


def stranded(cp: ControlPlane, service: str, weights: dict[str, Any]) -> list[Stranded]:
    """The versions of `service` that `weights` give traffic and that cannot take it. Weights
    that are no valid split are left to the weights API to refuse."""
    svc = cp.registry.overlay(cp.mesh).services.get(service)
    if svc is None:
        return []
    out = []
    for version, weight in weights.items():
        ver = svc.versions.get(version)
        if ver is None or isinstance(weight, bool) or not isinstance(weight, int) or weight <= 0:
            continue
        if any(host.healthy for host in ver.registered):
            continue
        if not ver.endpoints and ver.registered:
            reason = (
                f"{version}'s {len(ver.registered)} registered host(s) answer NOT_SERVING; "
                "start or fix their runtimes"
            )
            out.append(Stranded(service, version, weight, reason, no_endpoint=False))
            continue
        if not ver.endpoints:
            reason = (
                f"{version} has no endpoint in the mesh (add its inbound sidecar's: "
                f"services.{service}.versions.{version}.endpoints, or the admin API's POST "
                f"/v1/services/{service}/versions/{version}/endpoints) and no registered host "
                "(meshlm sidecar --register)"
            )
            out.append(Stranded(service, version, weight, reason, no_endpoint=True))
            continue
        probe = GrpcHealthSource(
            [str(e) for e in ver.endpoints], mtls=lambda: mtls_probe(cp, service)
        )
        down = not_live_reason(version, probe.read())
        if down:
            reason = f"{down}; start its runtime and sidecar"
            out.append(Stranded(service, version, weight, reason, no_endpoint=False))
    return out


def live(cp: ControlPlane) -> list[Stranded]:
    """Every version the live weights send traffic to and that cannot take it."""
    return [
        s
        for name, svc in cp.mesh.services.items()
        for s in stranded(cp, name, dict(svc.route.weights))
    ]


# `GET /traffic` needs no token and each answer probes the mesh's endpoints: while the desired
# mesh is the same, answers within this many seconds of the last probe reuse it, so polling
# clients never multiply the probes.
PROBE_REUSE_S = 2.0


def handle(cp: ControlPlane):  # -> admin Mount
    """`GET /traffic`: {"stranded": [...]} for the live weights."""
    lock = threading.Lock()
    last: list[Any] = [None, float("-inf"), []]  # the mesh probed, when, the answer

    def mount(method: str, target: str, body: bytes) -> tuple[int, Any]:
        if method != "GET" or target.split("?")[0].rstrip("/") != "/traffic":
            return 404, {"error": f"no such endpoint: {method} {target.split('?')[0]}"}
        with lock:
            mesh = cp.mesh
            if last[0] is not mesh or time.monotonic() - last[1] >= PROBE_REUSE_S:
                last[:] = [mesh, time.monotonic(), [s.to_json() for s in live(cp)]]
            return 200, {"stranded": last[2]}

    return mount

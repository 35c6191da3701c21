"""The rollout part of the admin HTTP API, as one function the admin server mounts under
`/rollouts`. Mutations are POSTs: the admin server checks its bearer token before calling them.

  GET  /rollouts                      every rollout's status
  GET  /rollouts/{service}            one rollout's status (state, weights, history, analyses)
  POST /rollouts/{service}            start; body: rollout spec fields (mesh file `rollouts:`
                                      shape) over the mesh file's spec for that service
  POST /rollouts/{service}/{action}   action: pause | resume | abort | promote
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from xds_server.mesh.rollout_spec import RolloutSpecError
from xds_server.rollout.controller import RolloutController, RolloutError

PREFIX = "/rollouts"
ACTIONS = ("pause", "resume", "abort", "promote")


def is_mutation(method: str, path: str) -> bool:
    """Whether the admin server must check the bearer token first."""
    return method.upper() != "GET"


def _body(body: bytes | str | dict[str, Any] | None) -> dict[str, Any]:
    if body is None or body in (b"", ""):
        return {}
    if isinstance(body, dict):
        return body
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise ValueError("expected a JSON object")
    return doc


class RolloutAPI:
    def __init__(
        self,
        controller: RolloutController,
        default_spec: Callable[[str], dict[str, Any] | None] | None = None,
    ) -> None:
        self.controller = controller
        self.default_spec = default_spec or (lambda service: None)

    def handle(
        self, method: str, path: str, body: bytes | str | dict[str, Any] | None = None
    ) -> tuple[int, Any]:
        """(HTTP status, JSON-able reply). Errors come back as {"error": message}."""
        method = method.upper()
        parts = [p for p in path.split("?", 1)[0].removeprefix(PREFIX).split("/") if p]
        try:
            if method == "GET" and not parts:
                return 200, self.controller.status()
            if method == "GET" and len(parts) == 1:
                return 200, self.controller.status(parts[0])
            if method == "POST" and len(parts) == 1:
                return 201, self._start(parts[0], _body(body))
            if method == "POST" and len(parts) == 2 and parts[1] in ACTIONS:
                return 200, getattr(self.controller, parts[1])(parts[0])
            if len(parts) > 2 or (len(parts) == 2 and parts[1] not in ACTIONS):
                return 404, {"error": f"no such rollout resource: {path}"}
            return 405, {"error": f"{method} not allowed on {path}"}
        except RolloutError as e:
            return e.status, {"error": str(e)}
        except (RolloutSpecError, ValueError) as e:
            return 400, {"error": str(e)}

    def _start(self, service: str, overrides: dict[str, Any]) -> dict[str, Any]:
        """The mesh file's spec for `service`, with the request's fields (and gates) on top."""
        overrides = {k: v for k, v in overrides.items() if k != "service"}
        base = dict(self.default_spec(service) or {})
        if not base and not overrides:
            raise RolloutError(
                f"{service}: no rollout spec in the request and none in the mesh file "
                f"(rollouts.{service})",
                status=400,
            )
        gates = {**(base.get("gates") or {}), **(overrides.get("gates") or {})}
        spec = {**base, **overrides}
        if gates:
            spec["gates"] = gates
        return self.controller.start({"service": service, **spec})


def spec_from_mesh(mesh: Any, service: str) -> dict[str, Any] | None:
    """The mesh file's `rollouts.<service>` (an `xds_server.mesh.Rollout`) as a spec dict."""
    r = getattr(mesh, "rollouts", {}).get(service)
    if r is None:
        return None
    return {
        "stable": r.stable,
        "canary": r.canary,
        "steps": list(r.steps),
        "interval": r.interval,
        "threshold": r.threshold,
        "gates": dict(r.gates),
        "ack_timeout": r.ack_timeout,
        **({"quality": r.quality} if r.quality is not None else {}),
    }

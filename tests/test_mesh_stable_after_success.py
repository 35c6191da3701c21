"""After a rollout Succeeds, the control plane's notion of stable follows it: `x-canary: never`
pins the new stable on a real caller-side Envoy (it used to keep pinning the mesh file's
`stable`), and a control plane restarted from the old mesh file pins it again on recovery."""

from __future__ import annotations

from pathlib import Path

from tests.rollout_upstreams import Upstream
from tests.test_rollout_envoy import caller_mesh, mesh, routed_to, sources
from xds_server.compose import build_server
from xds_server.rollout.controller import RolloutController

SPEC = {
    "service": "llm",
    "stable": "v1",
    "canary": "v2",
    "steps": [50, 100],
    "interval": "30s",
    "threshold": 1,
    "ack_timeout": "10s",
    "gates": {"grpc_success_rate_min": 99.0, "min_requests": 1},
}


def test_never_pins_the_new_stable_after_success(tmp_path: Path) -> None:
    store = str(tmp_path / "rollouts.json")
    with Upstream("v1") as v1, Upstream("v2") as v2, caller_mesh(v1, v2) as (cp, envoy, target):
        c = RolloutController(cp, store, sources(envoy), autorun=False)
        try:
            c.start(SPEC)
            assert routed_to(target, 10, "never") == {"v1": 10}
            assert routed_to(target, 10, "always") == {"v2": 10}
            st = c.promote("llm")
        finally:
            c.close()
        assert st["state"] == "Succeeded" and st["stable"] == "v2", st["message"]
        assert routed_to(target, 10) == {"v2": 10}
        assert routed_to(target, 10, "never") == {"v2": 10}
        assert routed_to(target, 10, "always") == {"v1": 10}  # the other version, still there

        # A control plane restarted from the mesh file (which still says v1 first) learns the
        # pins back from the persisted rollout.
        fresh = build_server(mesh(v1.port, v2.port))
        assert fresh.mesh.services["llm"].route.pins is None
        with RolloutController(fresh, store, sources(envoy), autorun=False) as again:
            assert again.status("llm")["state"] == "Succeeded"
        assert fresh.mesh.services["llm"].route.pins == ("v2", "v1")

"""Sticky sessions during a canary, on a real Envoy fed by the control plane: with the route's
`use_hash_policy` (Envoy's WeightedCluster.use_hash_policy) the version is picked by the hash of
the caller's session header, so a session stays on one version for a step; without it the pick
is random per request. The caller side hashes a header the client sends (`x-meshlm-session`),
not `x-meshlm-tenant`, which only the runtime-side authz filter sets."""

from __future__ import annotations

from collections import defaultdict

import pytest

from tests.test_xds_support import Caller, eventually, llm_mesh, sidecar, upstreams
from xds_server.compose import build_server
from xds_server.mesh import MeshError, parse_mesh

SESSION = "x-meshlm-session"


def _route(sticky: bool) -> dict:
    return {
        "weights": {"v1": 50, "v2": 50},
        "hash_policy": {"header": SESSION},
        "use_hash_policy": sticky,
    }


def test_use_hash_policy_needs_a_hash_policy() -> None:
    svc = {"versions": {"v1": {"endpoints": ["127.0.0.1:1"]}}}
    with pytest.raises(MeshError, match=r"services.llm.route.use_hash_policy: needs a hash_policy"):
        parse_mesh(
            {
                "services": {
                    "llm": {**svc, "route": {"weights": {"v1": 100}, "use_hash_policy": True}}
                }
            }
        )
    with pytest.raises(MeshError, match=r"route.use_hash_policy: expected true or false"):
        parse_mesh(
            {
                "services": {
                    "llm": {
                        **svc,
                        "route": {**_route(True), "weights": {"v1": 100}, "use_hash_policy": "yes"},
                    }
                }
            }
        )


def test_sessions_stick_to_one_version_per_step_and_spread_without_it() -> None:
    with upstreams("v1", "v2") as ups:
        cp = build_server(llm_mesh(ups, route=_route(True)), debounce=0.02).start()
        envoy, port = sidecar(cp, "sticky-1")
        try:
            with envoy:
                caller = Caller(port)
                eventually(lambda: caller.who(), what="the outbound route")
                seen: dict[str, set[str]] = defaultdict(set)
                for _ in range(8):
                    for s in range(20):
                        seen[f"session-{s}"].add(caller.who(((SESSION, f"session-{s}"),)))
                assert all(len(v) == 1 for v in seen.values()), dict(seen)
                # 20 sessions at 50/50: both versions get some (all on one: p = 2**-19).
                assert {v for (v,) in seen.values()} == {"v1", "v2"}, dict(seen)

                off = llm_mesh(ups, route=_route(False))
                assert cp.update_mesh(off, timeout=20).ok
                one = {caller.who(((SESSION, "session-0"),)) for _ in range(40)}
                assert one == {"v1", "v2"}  # random per request (one version: p = 2**-39)
                caller.close()
        finally:
            cp.stop()

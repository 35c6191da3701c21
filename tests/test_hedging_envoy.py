"""`retry_policy.hedge_on_per_try_timeout` on a real caller Envoy: with hedging, a try past its
per-try timeout keeps running while the next try races it, and the first answer wins; without,
the slow try is cancelled. Two real gRPC upstreams that each answer after 0.6 s, a 0.3 s
per-try timeout, one retry: each call reaches both hosts (the second try at 0.3 s). Hedged,
the first-tried host's answer comes back; without hedging both tries are cut and the call
fails (UNAVAILABLE, upstream request timeout)."""

from __future__ import annotations

import grpc
import pytest

from tests.test_xds_support import Caller, eventually, sidecar, upstreams
from xds_server.compose import build_server
from xds_server.mesh import MeshError, parse_mesh

DELAY = 0.6  # each upstream's answer
PER_TRY = "300ms"


def _raw(ups: dict, hedge: bool | None) -> dict:
    retry = {"retry_on": "gateway-error", "num_retries": 1, "per_try_timeout": PER_TRY}
    if hedge is not None:
        retry["hedge_on_per_try_timeout"] = hedge
    return {
        "services": {
            "llm": {
                "versions": {"v1": {"endpoints": [u.address for u in ups.values()]}},
                "route": {"weights": {"v1": 100}},
                "load_balancing": "round_robin",
                "retry_policy": retry,
            }
        }
    }


@pytest.mark.parametrize("hedge", [True, False], ids=["hedged", "retried"])
def test_hedging_keeps_the_first_try_racing_the_retry(hedge: bool) -> None:
    with upstreams("a", "b") as ups:
        cp = build_server(parse_mesh(_raw(ups, hedge)), debounce=0.02).start()
        envoy, port = sidecar(cp, f"hedge-{hedge}")
        try:
            with envoy:
                caller = Caller(port)
                eventually(lambda: caller.who(), what="the outbound route")
                for u in ups.values():
                    u.handler.delay = DELAY
                for _ in range(4):
                    for u in ups.values():
                        u.handler.arrivals.clear()
                    try:
                        answer = caller.who(timeout=10)
                    except grpc.RpcError as e:
                        assert not hedge, e
                        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                        answer = None
                    arrivals = {n: u.handler.arrivals for n, u in ups.items()}
                    assert all(len(a) == 1 for a in arrivals.values()), arrivals
                    if hedge:
                        assert answer == min(arrivals, key=lambda n: arrivals[n][0]), arrivals
                    else:
                        assert answer is None
                caller.close()
        finally:
            cp.stop()


def test_hedging_needs_a_per_try_timeout() -> None:
    raw = _raw({}, True)
    del raw["services"]["llm"]["retry_policy"]["per_try_timeout"]
    with pytest.raises(MeshError, match=r"retry_policy\.hedge_on_per_try_timeout: needs"):
        parse_mesh(raw)
    raw["services"]["llm"]["retry_policy"]["hedge_on_per_try_timeout"] = "yes"
    with pytest.raises(MeshError, match="hedge_on_per_try_timeout: expected true or false"):
        parse_mesh(raw)

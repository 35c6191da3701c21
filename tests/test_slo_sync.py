"""The SLO loop follows the live mesh and measures its own replicas (issue 12, item 4): a slo
block added by a later apply gets a loop, a removed one's actions are undone; the TTFT of a
replica the loop added counts in its readings."""

from __future__ import annotations

from typing import Any

from tests.test_slo_envoy import Metrics, started
from tests.test_xds_support import eventually
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.slo.loop import SloController, SloLoops

SLO = {"ttft_p99": "500ms", "interval": "100ms", "intervals": 1, "min_requests": 0}


def mesh_doc(metrics: Metrics, slo: dict | None, actions: list[str] | None = None) -> Any:
    svc: dict[str, Any] = {
        "versions": {
            "v1": {
                "endpoints": ["127.0.0.1:9"],
                "metrics_urls": [f"http://127.0.0.1:{metrics.server_port}/metrics"],
            }
        }
    }
    if slo is not None:
        svc["slo"] = {**slo, **({"actions": actions} if actions else {})}
    tenants = {
        name: {"key_sha256": hash_key(f"key-of-{name}-0123456789"), "allow": ["llm/*"],
               "priority": prio}
        for name, prio in (("gold", "high"), ("free", "low"))
    }  # fmt: skip
    return parse_mesh({"services": {"llm": svc}, "tenants": tenants})


def test_a_slo_block_applied_later_gets_a_loop_and_removing_it_undoes_its_actions() -> None:
    metrics = Metrics()
    metrics.ttft_ms = 1000.0  # breached from the start
    with build_server(mesh_doc(metrics, None), debounce=0.02) as cp:
        loops = SloLoops(cp, poll=0.05).start()
        try:
            assert loops.handle("GET", "/slo") == (200, {})
            assert cp.apply_mesh(mesh_doc(metrics, SLO, ["shed"])).ok
            eventually(
                lambda: cp.mesh.services["llm"].slo_state.shed_tenants == ("free",),
                10, "the applied block's loop sheds free",
            )  # fmt: skip
            code, body = loops.handle("GET", "/slo/llm")
            assert code == 200 and body["in_force"] == ["shed"]
            assert body["history"][0]["reason"].startswith("TTFT p99 1000ms (SLO 500ms)")

            assert cp.apply_mesh(mesh_doc(metrics, None)).ok  # the block removed
            eventually(
                lambda: loops.handle("GET", "/slo")[1] == {}, 10, "the loop of the block ended"
            )
            assert cp.mesh.services["llm"].slo_state.shed_tenants == ()
        finally:
            loops.stop()
        metrics.shutdown()


class ReplicasFake:
    """A fake Scaler whose replicas are only an endpoint and a runtime metrics endpoint."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics, self.out = metrics, 0

    def scale_out(self, service: str, version: str) -> str:
        self.out += 1
        return "127.0.0.1:10"

    def scale_in(self, service: str, version: str, endpoint: str) -> None:
        self.out -= 1

    def metrics_url(self, endpoint: str) -> str:
        return f"http://127.0.0.1:{self.metrics.server_port}/metrics"


def test_the_ttft_of_a_replica_the_loop_added_counts_in_its_readings() -> None:
    version, replica = Metrics(), Metrics()
    version.ttft_ms = replica.ttft_ms = 1000.0
    slo = {**SLO, "recover_intervals": 1}
    with build_server(mesh_doc(version, slo, ["scale_out"]), debounce=0.02) as cp:
        scaler = ReplicasFake(replica)
        loop = SloController(cp, "llm", scaler=scaler)
        loop.tick()
        assert started(loop)["replicas"] == ["127.0.0.1:10"] and scaler.out == 1
        version.ttft_ms = 100.0  # the first replica is fine, the added one is not
        last = loop.tick()
        assert last["reading"]["ttft_p99"] == 1.0 and last["deviation"] == 1.0
        assert scaler.out == 1  # not "held": the replica stays
        replica.ttft_ms = 100.0
        loop.tick()
        assert scaler.out == 0 and loop.history[-1]["direction"] == "undo"
    version.shutdown()
    replica.shutdown()

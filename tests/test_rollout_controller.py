"""The rollout state machine's decisions, stepped by hand (`autorun=False`, `tick(force=True)`).

Fakes, named as such: `FakeGrpcCounts`/`FakeLatency` stand in for the measurement sources and
`FakeControlPlane` for the ACK-waiting control plane, so every branch can be driven exactly. The
same controller runs against real Envoy and the real control plane in
tests/test_rollout_envoy.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from xds_server.mesh import parse_mesh
from xds_server.mesh.rollout_spec import RolloutSpecError, parse_rollout
from xds_server.rollout.controller import RolloutController, RolloutError
from xds_server.rollout.gates.envoy_stats import GrpcCounts
from xds_server.rollout.gates.fetch import MeasurementError
from xds_server.rollout.gates.runtime_metrics import LatencyReading
from xds_server.rollout.gates.sources import Sources
from xds_server.store.state_file import RolloutStore, RolloutStoreError


@dataclass
class FakeApplyResult:
    ok: bool
    missing: list[str] = field(default_factory=list)


class FakeControlPlane:
    """Records every weight change; `lagging` names sidecars that will not ACK."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, int]]] = []
        self.lagging: list[str] = []
        self.refuse: str | None = None

    def set_weights(self, service: str, weights: dict[str, int], *, timeout: float) -> Any:
        if self.refuse:
            raise ValueError(self.refuse)
        self.calls.append((service, dict(weights)))
        return FakeApplyResult(not self.lagging, list(self.lagging))


class FakeGrpcCounts:
    """Cumulative counters of one caller-side sidecar; a test adds calls between ticks."""

    def __init__(self) -> None:
        self.c = GrpcCounts()
        self.down = False

    def add(self, ok: int, unavailable: int = 0) -> None:
        codes = dict(self.c.by_status)
        codes["0"] = codes.get("0", 0) + ok
        if unavailable:
            codes["14"] = codes.get("14", 0) + unavailable
        c, n = self.c, ok + unavailable
        self.c = GrpcCounts(c.total + n, c.success + ok, c.failure + unavailable, codes)

    def read(self) -> dict[str, GrpcCounts]:
        if self.down:
            raise MeasurementError("http://127.0.0.1:1/stats: connection refused")
        return {"caller-0": self.c}


class FakeLatency:
    """Every interval reads these p99s (histogram arithmetic: tests/test_rollout_gates.py)."""

    def __init__(self, ttft: float | None = 0.1, tpot: float | None = 0.02) -> None:
        self.ttft, self.tpot = ttft, tpot

    def snapshot(self) -> FakeLatency:
        return self

    def since(self, before: FakeLatency) -> LatencyReading:
        return LatencyReading(self.ttft, self.tpot, 100, "interval")


SPEC = {
    "stable": "v1",
    "canary": "v2",
    "steps": [5, 25, 50, 100],
    "interval": "1s",
    "threshold": 2,
    "gates": {"grpc_success_rate_min": 99.0, "ttft_p99_max": "800ms", "min_requests": 20},
}


@pytest.fixture
def rig(tmp_path: Path):
    cp, grpc_src, lat = FakeControlPlane(), FakeGrpcCounts(), FakeLatency()
    store = tmp_path / "rollouts.json"

    def controller() -> RolloutController:
        return RolloutController(cp, str(store), lambda spec: Sources(grpc_src, lat), autorun=False)

    return cp, grpc_src, lat, store, controller


def mesh_weighted(weights: dict[str, int]):
    versions = {v: {"endpoints": ["127.0.0.1:1"]} for v in weights}
    return parse_mesh({"services": {"llm": {"versions": versions, "route": {"weights": weights}}}})


def canary_weights(cp: FakeControlPlane) -> list[int]:
    return [w["v2"] for _, w in cp.calls]


def test_healthy_canary_promotes_step_by_step_fake_metrics(rig) -> None:
    cp, src, _, _, make = rig
    c = make()
    st = c.start({"service": "llm", **SPEC})
    assert st["state"] == "Progressing" and st["weights"] == {"v1": 95, "v2": 5}
    for _ in range(3):
        src.add(ok=50)
        c.tick("llm", force=True)
    st = c.status("llm")
    assert st["state"] == "Succeeded"
    assert st["stable"] == "v2" and st["weights"] == {"v1": 0, "v2": 100}
    assert canary_weights(cp) == [5, 25, 50, 100]
    states = [h["to"] for h in st["history"]]
    assert states == ["Pending", "Progressing", "Progressing", "Progressing", "Promoting",
                      "Succeeded"]  # fmt: skip
    assert all(h["time"] > 0 and h["reason"] for h in st["history"])
    assert [t["canary_requests"] for t in st["traffic"]] == [50, 50, 50]


def test_too_little_traffic_halts_fake_metrics(rig) -> None:
    cp, src, _, _, make = rig
    c = make()
    c.start({"service": "llm", **SPEC})
    for _ in range(5):
        src.add(ok=3)  # all healthy, but below min_requests
        c.tick("llm", force=True)
    st = c.status("llm")
    assert st["state"] == "Progressing" and st["canary_weight"] == 5
    assert "not enough traffic" in st["message"]
    # ...and says what to do about it.
    assert "20 calls to the canary in 1s at 5 % take about 400 calls/s in all" in st["message"]
    assert "`x-canary: always`" in st["message"] and "--min-requests" in st["message"]
    assert "higher first step (--steps " in st["message"]
    assert st["failures"] == 0
    assert canary_weights(cp) == [5]
    assert {a["outcome"] for a in st["analyses"]} == {"halt"}


def test_failures_below_min_requests_roll_back_fake_metrics(rig) -> None:
    # Issue 9: 5 calls that all failed are failed intervals, not "too little traffic".
    cp, src, _, _, make = rig
    c = make()
    c.start({"service": "llm", **SPEC})
    for _ in range(2):
        src.add(ok=0, unavailable=5)  # min_requests is 20
        c.tick("llm", force=True)
    st = c.status("llm")
    assert st["state"] == "RolledBack" and st["weights"] == {"v1": 100, "v2": 0}
    assert "5 of 5 calls to the canary failed" in st["message"]
    assert [a["outcome"] for a in st["analyses"]] == ["fail", "fail"]
    assert canary_weights(cp) == [5, 0]


def test_failing_gates_roll_back_after_threshold_never_beyond_step_fake_metrics(rig) -> None:
    cp, src, _, _, make = rig
    c = make()
    c.start({"service": "llm", **SPEC})
    src.add(ok=100)
    c.tick("llm", force=True)  # pass: 25 %
    src.add(ok=90, unavailable=10)
    c.tick("llm", force=True)  # fail 1/2: stays at 25 %
    st = c.status("llm")
    assert st["state"] == "Progressing" and st["canary_weight"] == 25 and st["failures"] == 1
    src.add(ok=90, unavailable=10)
    c.tick("llm", force=True)  # fail 2/2: rollback
    st = c.status("llm")
    assert st["state"] == "RolledBack"
    assert st["weights"] == {"v1": 100, "v2": 0}
    assert "90.00%" in st["message"] and "'14': 10" in st["message"]
    assert canary_weights(cp) == [5, 25, 0]  # never beyond the step where it failed
    assert max(canary_weights(cp)) == 25


def test_a_pass_between_failures_resets_the_count_fake_metrics(rig) -> None:
    _, src, _, _, make = rig
    c = make()
    c.start({"service": "llm", **SPEC, "steps": [10, 20, 30, 40, 100], "threshold": 2})
    src.add(ok=90, unavailable=10)
    c.tick("llm", force=True)  # fail 1
    src.add(ok=3)
    c.tick("llm", force=True)  # halt: no change to the failure count
    assert c.status("llm")["failures"] == 1
    src.add(ok=100)
    c.tick("llm", force=True)  # pass: next step, count reset
    src.add(ok=90, unavailable=10)
    c.tick("llm", force=True)  # fail 1 at 20 %
    st = c.status("llm")
    assert st["state"] == "Progressing" and st["canary_weight"] == 20 and st["failures"] == 1


def test_slow_ttft_fails_the_gate_fake_metrics(rig) -> None:
    _, src, lat, _, make = rig
    c = make()
    c.start({"service": "llm", **SPEC, "threshold": 1})
    lat.ttft = 1.2
    src.add(ok=100)
    c.tick("llm", force=True)
    st = c.status("llm")
    assert st["state"] == "RolledBack" and "TTFT p99 1200ms > 800ms" in st["message"]


def test_unreachable_sidecar_stats_halt_not_fail_fake_metrics(rig) -> None:
    _, src, _, _, make = rig
    c = make()
    c.start({"service": "llm", **SPEC, "threshold": 1})
    src.add(ok=100)
    src.down = True
    c.tick("llm", force=True)
    st = c.status("llm")
    assert st["state"] == "Progressing" and "gRPC counts unavailable" in st["message"]


def test_pause_resume_abort_fake_metrics(rig) -> None:
    cp, src, _, _, make = rig
    c = make()
    c.start({"service": "llm", **SPEC})
    assert c.pause("llm")["state"] == "Paused"
    src.add(ok=100)
    c.tick("llm", force=True)  # paused: no analysis
    assert c.status("llm")["canary_weight"] == 5
    with pytest.raises(RolloutError):
        c.pause("llm")
    st = c.resume("llm")
    assert st["state"] == "Progressing" and canary_weights(cp) == [5, 5]  # re-applied
    st = c.abort("llm")
    assert st["state"] == "RolledBack" and "aborted by operator" in st["message"]
    assert canary_weights(cp)[-1] == 0
    with pytest.raises(RolloutError) as e:
        c.resume("llm")
    assert e.value.status == 409


def test_manual_promote_skips_to_100_then_canary_is_stable_fake_metrics(rig) -> None:
    cp, _, _, _, make = rig
    c = make()
    c.start({"service": "llm", **SPEC})
    st = c.promote("llm")
    assert st["state"] == "Succeeded" and st["stable"] == "v2"
    assert canary_weights(cp) == [5, 100]
    # a new rollout of the same canary is refused: it is stable already
    with pytest.raises(RolloutError):
        c.start({"service": "llm", **SPEC})


def test_a_promoted_canary_weighted_back_down_can_roll_out_again_fake_metrics(rig) -> None:
    """`meshlm weights llm v1=100 v2=0` after v2 was promoted: v2 serves nothing, so a new
    rollout of it starts; while it serves everything, it is refused as stable already."""
    cp, _, _, _, make = rig
    c = make()
    c.start({"service": "llm", **SPEC})
    c.promote("llm")
    cp.mesh = mesh_weighted({"v1": 0, "v2": 100})
    with pytest.raises(RolloutError, match="already stable"):
        c.start({"service": "llm", **SPEC})
    cp.mesh = mesh_weighted({"v1": 100, "v2": 0})
    assert c.start({"service": "llm", **SPEC})["state"] == "Progressing"


def test_ack_timeout_pauses_with_lagging_sidecars_and_does_not_count_fake_metrics(rig) -> None:
    cp, src, _, _, make = rig
    c = make()
    c.start({"service": "llm", **SPEC})
    cp.lagging = ["caller-3"]
    src.add(ok=100)
    c.tick("llm", force=True)  # pass -> 25 %, but caller-3 never ACKs
    st = c.status("llm")
    assert st["state"] == "Paused" and "caller-3" in st["message"]
    assert st["lagging"] == ["caller-3"]
    src.add(ok=100)
    c.tick("llm", force=True)  # paused: nothing moves on
    assert canary_weights(cp) == [5, 25]
    cp.lagging = []
    st = c.resume("llm")
    assert st["state"] == "Progressing" and st["canary_weight"] == 25


def test_promotion_not_acked_keeps_stable_until_acked_fake_metrics(rig) -> None:
    cp, _, _, _, make = rig
    c = make()
    c.start({"service": "llm", **SPEC})
    cp.lagging = ["caller-1"]
    st = c.promote("llm")
    assert st["state"] == "Paused" and st["stable"] == "v1"  # not stable before every ACK
    cp.lagging = []
    st = c.resume("llm")
    assert st["state"] == "Succeeded" and st["stable"] == "v2"


def test_refused_weights_fail_and_roll_back_fake_metrics(rig) -> None:
    cp, _, _, _, make = rig
    c = make()
    cp.refuse = "services.llm.route.weights.v2: unknown version"
    st = c.start({"service": "llm", **SPEC})
    assert st["state"] == "Failed" and "unknown version" in st["message"]


def test_rollout_resumes_after_restart_fake_metrics(rig) -> None:
    cp, src, _, store, make = rig
    c = make()
    c.start({"service": "llm", **SPEC})
    src.add(ok=100)
    c.tick("llm", force=True)  # 25 %
    src.add(ok=80, unavailable=20)
    c.tick("llm", force=True)  # failure 1/2 at 25 %
    c.close()
    on_disk = json.loads(store.read_text())["rollouts"]["llm"]
    assert on_disk["state"] == "Progressing" and on_disk["canary_weight"] == 25

    cp.calls.clear()
    c2 = make()  # a new control plane reading the same store
    assert canary_weights(cp) == [25]  # the current step's weights are re-applied
    st = c2.status("llm")
    assert st["state"] == "Progressing" and st["failures"] == 1
    assert "restarted" in st["history"][-1]["reason"]
    src.add(ok=80, unavailable=20)
    c2.tick("llm", force=True)  # the second failure in a row, across the restart
    assert c2.status("llm")["state"] == "RolledBack"


def test_second_rollout_while_active_is_refused_fake_metrics(rig) -> None:
    _, _, _, _, make = rig
    c = make()
    c.start({"service": "llm", **SPEC})
    with pytest.raises(RolloutError) as e:
        c.start({"service": "llm", **SPEC})
    assert e.value.status == 409
    with pytest.raises(RolloutError) as e:
        c.status("other")
    assert e.value.status == 404


def test_spec_errors_name_the_field() -> None:
    with pytest.raises(RolloutSpecError, match=r"rollouts.llm.steps: weights must increase"):
        parse_rollout("llm", {"stable": "v1", "canary": "v2", "steps": [50, 25]})
    with pytest.raises(RolloutSpecError, match=r"rollouts.llm.gates.grpc_success_rate_min"):
        bad = {"grpc_success_rate_min": 101}
        parse_rollout("llm", {"stable": "v1", "canary": "v2", "gates": bad})
    with pytest.raises(RolloutSpecError, match=r"rollouts.llm.interval"):
        parse_rollout("llm", {"stable": "v1", "canary": "v2", "interval": "soon"})
    with pytest.raises(RolloutSpecError, match=r"rollouts\.llm\.gates\.p99: unknown gate"):
        parse_rollout("llm", {"stable": "v1", "canary": "v2", "gates": {"p99": 1}})
    with pytest.raises(RolloutSpecError, match=r"rollouts\.llm\.ack_timeout: at most 600s"):
        parse_rollout("llm", {"stable": "v1", "canary": "v2", "ack_timeout": "11m"})
    spec = parse_rollout("llm", {"stable": "v1", "canary": "v2", "steps": [10, 50]})
    assert spec.steps == (10, 50, 100)
    assert parse_rollout("llm", SPEC).gates.ttft_p99_max == pytest.approx(0.8)


def test_store_is_atomic_and_a_corrupt_file_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    store = RolloutStore(path)
    assert store.load() == {}
    store.save({"llm": {"state": "Progressing"}})
    assert store.load() == {"llm": {"state": "Progressing"}}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temp file left behind
    path.write_text("{half")
    with pytest.raises(RolloutStoreError, match="not valid JSON"):
        store.load()
    assert path.read_text() == "{half"

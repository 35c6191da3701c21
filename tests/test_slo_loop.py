"""The SLO loop's decisions (xds_server/slo/loop.py) and the mesh file's `slo` and `load_balancing`
settings: acts after N breached intervals, undoes after the SLO held, never flaps."""

from __future__ import annotations

import pytest

from xds_server.mesh import MeshError, Slo, parse_mesh
from xds_server.slo.loop import Hysteresis, Reading, deviation, lowest_priority_tenants, steps

SLO = Slo(ttft_p99=0.5, success_rate=99.0, deviation=0.15, intervals=3, recover_intervals=6)


def service(**extra: object) -> dict:
    return {"versions": {"v1": {"endpoints": ["127.0.0.1:9"]}}, **extra}


def mesh_error(**extra: object) -> str:
    with pytest.raises(MeshError) as e:
        parse_mesh({"services": {"llm": service(**extra)}})
    return str(e.value)


def test_deviation_is_the_worst_objective_against_its_target() -> None:
    dev, what = deviation(SLO, Reading(requests=100, success_rate=99.5, ttft_p99=0.75))
    assert dev == pytest.approx(0.5) and what.startswith("TTFT p99 750ms")
    # 98 % for a 99 % SLO spends the error budget twice over: +100 %.
    dev, what = deviation(SLO, Reading(requests=100, success_rate=98.0, ttft_p99=0.4))
    assert dev == pytest.approx(1.0) and what.startswith("success 98.00%")
    assert deviation(SLO, Reading(requests=3, ttft_p99=5.0))[0] is None  # too few calls
    assert deviation(SLO, Reading())[0] is None  # nothing measured: no verdict


def run(h: Hysteresis, devs: list[float | None]) -> list[int]:
    return [h.observe(d) for d in devs]


def test_acts_after_n_breached_intervals_in_order_and_undoes_after_recovery() -> None:
    h = Hysteresis(SLO, steps=3)
    assert run(h, [0.5, 0.5, 0.5]) == [0, 0, 1]
    assert run(h, [0.5, 0.5, 0.5]) == [0, 0, 1]  # the next action needs N more
    assert h.level == 2
    assert run(h, [-0.1] * 6) == [0] * 5 + [-1]  # undo needs recover_intervals (2N)
    assert run(h, [-0.1] * 6) == [0] * 5 + [-1]
    assert h.level == 0
    assert run(h, [-0.1] * 12) == [0] * 12  # nothing left to undo


@pytest.mark.parametrize(
    "pattern",
    [
        [0.5, -0.1],  # breached and met in turn
        [0.5, 0.5, -0.1],  # one short of N, over and over
        [0.5, 0.5, 0.1],  # inside the band breaks the run
        [0.5, 0.5, None],  # an interval without data breaks it too
    ],
)
def test_an_oscillating_signal_never_acts(pattern: list[float | None]) -> None:
    h = Hysteresis(SLO, steps=3)
    assert run(h, pattern * 20) == [0] * (len(pattern) * 20)


def test_does_not_flap_around_the_threshold_once_acted() -> None:
    """Breach long enough to act, then a signal that hovers between the SLO and the threshold
    (met twice, in the band once, again and again): the action stays, nothing toggles."""
    h = Hysteresis(SLO, steps=3)
    run(h, [0.5] * 3)
    decisions = run(h, [-0.05, -0.05, 0.1] * 20)
    assert decisions == [0] * 60 and h.level == 1


def test_steps_repeat_scale_out_per_replica() -> None:
    slo = Slo(ttft_p99=1.0, actions=("shed", "scale_out"), max_replicas=2)
    assert steps(slo) == ["shed", "scale_out", "scale_out"]


def test_the_mesh_slo_block_is_validated_strictly() -> None:
    svc = parse_mesh(
        {"services": {"llm": service(slo={"ttft_p99": "800ms", "intervals": 2})}}
    ).services["llm"]
    assert svc.slo == Slo(ttft_p99=0.8, intervals=2, recover_intervals=4)
    assert mesh_error(slo={}) == (
        "services.llm.slo: needs at least one of ttft_p99, tpot_p99, success_rate"
    )
    assert mesh_error(slo={"ttft_p99": "1s", "deviation": "0%"}).startswith(
        "services.llm.slo.deviation: expected a rate"
    )
    assert mesh_error(slo={"ttft_p99": "1s", "actions": ["reboot"]}).startswith(
        "services.llm.slo.actions[0]: expected one of shed"
    )
    assert mesh_error(slo={"success_rate": 100}).startswith("services.llm.slo.success_rate:")
    assert mesh_error(slo={"ttft_p99": "1s", "intervals": 3, "recover_intervals": 2}) == (
        "services.llm.slo.recover_intervals: 2 out of range 3..1000"
    )
    assert mesh_error(slo={"ttft_p99": "1s", "speed": 1}).startswith(
        "services.llm.slo.speed: unknown field"
    )


def test_load_balancing_is_validated_and_defaults_follow_hash_policy() -> None:
    def lb(**extra: object) -> str:
        return parse_mesh({"services": {"llm": service(**extra)}}).services["llm"].load_balancing

    sticky = {"weights": {"v1": 100}, "hash_policy": {"header": "x-meshlm-tenant"}}
    assert lb() == "round_robin"
    assert lb(route=sticky) == "ring_hash"
    assert lb(route=sticky, load_balancing="least_loaded") == "least_loaded"
    assert mesh_error(load_balancing="fastest") == (
        "services.llm.load_balancing: expected one of least_loaded, round_robin, ring_hash, "
        "prefix_aware, got 'fastest'"
    )
    assert mesh_error(load_balancing="ring_hash") == (
        "services.llm.load_balancing: ring_hash needs route.hash_policy (the header to hash)"
    )


def test_shedding_picks_the_lowest_priority_only_when_a_higher_one_shares_the_service() -> None:
    from wasm_filters.policy import hash_key

    def tenants(**prios: str) -> dict:
        return {
            n: {"key_sha256": hash_key(n * 8), "allow": ["llm/*"], "priority": p}
            for n, p in prios.items()
        }

    mesh = parse_mesh(
        {"services": {"llm": service()}, "tenants": tenants(a="high", b="low", c="low")}
    )
    assert lowest_priority_tenants(mesh, "llm") == ("b", "c")
    same = parse_mesh({"services": {"llm": service()}, "tenants": tenants(a="low", b="low")})
    assert lowest_priority_tenants(same, "llm") == ()

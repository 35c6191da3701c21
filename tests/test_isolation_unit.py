"""Semantic circuit breaking without Envoy: the mesh file's `isolation` block, the outcome
windows (bounded), trip / half-open / relapse / release, the store, and the routes it makes."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2 as data_pb2

from xds_server.mesh import MeshError, parse_mesh
from xds_server.resources.routes import QUARANTINED_MESSAGE, outbound_route_config
from xds_server.slo.access_log_service import outcome
from xds_server.slo.quarantine import HALF_OPEN_SUCCESSES, Isolation, IsolationError

POISON = "00000000deadbeef"


def mesh(**isolation: Any):
    iso = {"error_rate": "50%", "window": "10s", "min_requests": 4, "cooldown": "5s", **isolation}
    return parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {
                        "v1": {"endpoints": ["127.0.0.1:1001"]},
                        "q": {"endpoints": ["127.0.0.1:1002"]},
                    },
                    "route": {"weights": {"v1": 100, "q": 0}},
                    "isolation": iso,
                }
            }
        }
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def engine(store=None, **isolation: Any) -> tuple[Isolation, Clock]:
    live = mesh(**isolation)
    clock = Clock()
    return Isolation(lambda: live, store, clock=clock), clock


@pytest.mark.parametrize(
    ("iso", "message"),
    [
        ({"window": "10m"}, "services.llm.isolation.error_rate: required"),
        ({"error_rate": "0%"}, "services.llm.isolation.error_rate: expected a rate"),
        ({"error_rate": "abc%"}, "services.llm.isolation.error_rate: expected a rate"),
        ({"error_rate": 1.5}, "services.llm.isolation.error_rate: expected a rate"),
        ({"error_rate": "1%", "pool": "v7"}, "services.llm.isolation.pool: unknown version"),
        ({"error_rate": "1%", "pool": "v1"}, "services.llm.isolation.pool: version v1 must have"),
        ({"error_rate": "1%", "min_requests": 0}, "services.llm.isolation.min_requests:"),
        ({"error_rate": "1%", "max_classes": "many"}, "services.llm.isolation.max_classes:"),
        ({"error_rate": "1%", "cooldown": "0s"}, "services.llm.isolation.cooldown:"),
        ({"error_rate": "1%", "windw": "1m"}, "services.llm.isolation.windw: unknown field"),
    ],
)
def test_isolation_block_errors_name_the_field(iso: dict, message: str) -> None:
    raw = {
        "services": {
            "llm": {
                "versions": {"v1": {}, "q": {}},
                "route": {"weights": {"v1": 100, "q": 0}},
                "isolation": iso,
            }
        }
    }
    with pytest.raises(MeshError, match="^" + message.replace(".", r"\.")):
        parse_mesh(raw)


def test_isolation_block_parses() -> None:
    iso = mesh(error_rate="0.8%", pool="q", max_classes=7).services["llm"].isolation
    assert (iso.error_rate, iso.window, iso.min_requests, iso.pool, iso.max_classes) == (
        pytest.approx(0.008),
        10.0,
        4,
        "q",
        7,
    )


def test_a_failing_class_trips_only_with_the_minimum_volume_and_others_stay() -> None:
    iso, _ = engine()
    for _ in range(3):
        assert iso.observe("llm", POISON, True) is None  # under min_requests
        assert iso.observe("llm", "1111111111111111", False) is None
    assert iso.observe("llm", POISON, True, reason="grpc-status 14") == "trip"
    for _ in range(10):
        iso.observe("llm", "1111111111111111", False)
    (q,) = iso.status()["llm"]["quarantined"]
    assert (q["key"], q["state"]) == (POISON, "open")
    assert "4 of 4 calls failed" in q["why"] and "grpc-status 14" in q["why"]
    assert iso.changed.is_set()


def test_failures_older_than_the_window_do_not_count() -> None:
    iso, clock = engine()
    for _ in range(3):
        iso.observe("llm", POISON, True)
    clock.now += 11  # the window is 10 s
    for _ in range(3):
        assert iso.observe("llm", POISON, False) is None
    assert iso.observe("llm", POISON, True) is None  # 1 of 4 < 50 %


def test_denials_and_unknown_services_are_ignored() -> None:
    iso, _ = engine()
    assert iso.observe("other", POISON, True) is None
    assert iso.observe("llm", "NOT-A-HASH", True) is None
    assert iso.tracked("llm") == 0


def test_memory_stays_bounded_under_100000_distinct_classes() -> None:
    iso, _ = engine(max_classes=1000, min_requests=2)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for i in range(100_000):
            iso.observe("llm", f"{i:016x}", i % 2 == 0)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert iso.tracked("llm") == 1000
    assert used - base < 2 << 20  # about 1000 small windows, not 100,000


def trip(iso: Isolation) -> None:
    for _ in range(4):
        iso.observe("llm", POISON, True)


def routes_of(iso: Isolation, live) -> list:
    """The service's routes after the first, which refuses clients' ORCA calls."""
    routes = outbound_route_config(iso.overlay(live)).virtual_hosts[0].routes
    assert routes[0].name == "llm-orca-refused"
    return routes[1:]


def test_half_open_after_the_cooldown_then_release_after_good_probes() -> None:
    live = mesh(pool="q")
    clock = Clock()
    iso = Isolation(lambda: live, clock=clock)
    trip(iso)
    first = routes_of(iso, live)[0]
    assert first.name == f"llm-isolation-{POISON}"
    assert first.route.cluster == "outbound|llm|q"
    assert not first.match.HasField("runtime_fraction")
    assert iso.tick() is False
    clock.now += 5
    assert iso.tick() is True
    first = routes_of(iso, live)[0]
    assert first.match.runtime_fraction.default_value.numerator == 90  # 10 % probe the pool
    for _ in range(HALF_OPEN_SUCCESSES - 1):
        assert iso.observe("llm", POISON, False) is None
    assert iso.observe("llm", POISON, False, rerouted=True) is None  # the pool's calls: no probe
    assert iso.observe("llm", POISON, False) == "release"
    assert iso.status()["llm"]["quarantined"] == []
    assert not [r for r in routes_of(iso, live) if "isolation" in r.name]


def test_a_relapse_in_half_open_backs_off_exponentially() -> None:
    iso, clock = engine()
    trip(iso)
    cooldowns = []
    for _ in range(3):
        clock.now += 1000
        iso.tick()
        assert iso.observe("llm", POISON, True, reason="upstream_remote_reset") == "relapse"
        (q,) = iso.status()["llm"]["quarantined"]
        cooldowns.append(q["cooldown"])
        assert q["state"] == "open" and "upstream_remote_reset" in q["why"]
    assert cooldowns == [10.0, 20.0, 40.0]


def test_no_pool_answers_unavailable_with_a_message() -> None:
    live = mesh()
    iso = Isolation(lambda: live, clock=Clock())
    trip(iso)
    first = routes_of(iso, live)[0]
    assert first.direct_response.status == 503  # a gRPC caller gets UNAVAILABLE
    assert first.direct_response.body.inline_string == QUARANTINED_MESSAGE


def test_operator_pin_and_release(tmp_path) -> None:
    iso, clock = engine()
    assert iso.handle("POST", f"/isolation/llm/{POISON}/pin")[1]["state"] == "pinned"
    clock.now += 10_000
    assert iso.tick() is False  # pinned: never half-open
    assert iso.handle("POST", "/isolation/llm/zz/pin")[0] == 400
    assert iso.handle("POST", f"/isolation/nope/{POISON}/pin")[0] == 404
    assert iso.handle("GET", f"/isolation/llm/{POISON}/release")[0] == 405
    assert iso.handle("POST", f"/isolation/llm/{POISON}/release")[0] == 200
    assert iso.handle("POST", f"/isolation/llm/{POISON}/release")[0] == 404


def test_the_store_keeps_quarantines_across_restarts(tmp_path) -> None:
    store = tmp_path / "isolation.json"
    iso, _ = engine(store)
    trip(iso)
    assert json.loads(store.read_text())["quarantined"][0]["key"] == POISON
    again, _ = engine(store)
    (q,) = again.status()["llm"]["quarantined"]
    assert (q["key"], q["state"]) == (POISON, "open")
    store.write_text("{not json")
    with pytest.raises(IsolationError, match="not valid JSON"):
        engine(store)


def entry(**kw: Any) -> data_pb2.HTTPAccessLogEntry:
    e = data_pb2.HTTPAccessLogEntry()
    e.request.authority = "llm"
    e.request.request_headers["x-meshlm-class"] = POISON
    e.common_properties.route_name = kw.pop("route", "llm-weighted")
    e.response.response_code.value = kw.pop("code", 200)
    for k, v in kw.pop("trailers", {}).items():
        e.response.response_trailers[k] = v
    for flag in kw.pop("flags", ()):
        setattr(e.common_properties.response_flags, flag, True)
    return e


def test_outcomes_from_access_log_entries() -> None:
    assert outcome(entry(trailers={"grpc-status": "0"}))[2] is False
    assert outcome(entry(trailers={"grpc-status": "13"}))[2] is True
    # UNAVAILABLE from the runtime itself (loading, draining): the pool's state, not the class.
    assert outcome(entry(trailers={"grpc-status": "14", "grpc-message": "still loading"})) is None
    assert outcome(entry(trailers={"grpc-status": "16"}))[2] is False  # a denial
    assert outcome(entry(trailers={"grpc-status": "8"}))[2] is False  # a rate limit
    assert outcome(entry(flags=["upstream_remote_reset"]))[2:] == (
        True, False, "upstream_remote_reset"
    )  # fmt: skip
    mid_stream = entry(flags=["upstream_remote_reset"])
    mid_stream.common_properties.time_to_first_upstream_rx_byte.FromMilliseconds(40)
    assert outcome(mid_stream) is None  # in flight beside a crash, not its cause
    assert outcome(entry(flags=["downstream_remote_reset"], code=0))[2] is False  # caller left
    assert outcome(entry(code=0))[2] is True  # no response at all
    assert outcome(entry(route=f"llm-isolation-{POISON}", trailers={"grpc-status": "13"}))[3]
    # The pool was down when it came: nothing about its class.
    before = "upstream connect error or disconnect/reset before headers. reset reason: "
    gone = {"grpc-status": "14", "grpc-message": before + "remote connection failure"}
    assert outcome(entry(trailers=gone)) is None
    assert outcome(entry(flags=["no_healthy_upstream", "upstream_retry_limit_exceeded"])) is None
    died = {"grpc-status": "14", "grpc-message": before + "connection termination"}
    # It was in flight when the runtime died.
    assert outcome(entry(trailers=died))[2:] == (
        True, False, "grpc-status 14 (connection termination)"
    )  # fmt: skip
    e = entry()
    del e.request.request_headers["x-meshlm-class"]
    assert outcome(e) is None

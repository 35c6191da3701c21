"""A scale-out starts its replica off the SLO loop's interval (xds_server/slo/loop.py): while the
replica loads, every interval is still measured and published, but no action is taken; the
replica is added by EDS when its start returns; a failed start is recorded with its reason and
leaves nothing in force; closing or undoing the loop meanwhile stops the replica it produces.
The scaler is a fake that blocks until the test lets it return (the real LocalScaler is run in
test_slo_local_scaler.py and the slo scenario)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.test_slo_envoy import Metrics
from tests.test_xds_support import eventually
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.server import XdsServer
from xds_server.slo.loop import Reading, SloController, SloLoops
from xds_server.slo.scaler import ScalerError

REPLICA = "127.0.0.1:11"  # the first start's; the next get :12, :13...
BREACHED, MET = Reading(ttft_p99=2.0), Reading(ttft_p99=0.1)


class BlockingScalerFake:
    """A fake Scaler whose `scale_out` waits for `go`, then returns an endpoint or raises
    `fail`."""

    timeout = 10.0  # what the loop waits for a start in flight, plus its margin

    def __init__(self, fail: str | None = None) -> None:
        self.go, self.fail = threading.Event(), fail
        self.calls = 0
        self.running: list[str] = []
        self.stopped: list[str] = []

    def scale_out(self, service: str, version: str) -> str:
        self.calls += 1
        assert self.go.wait(30), "the test never let the start return"
        if self.fail:
            raise ScalerError(self.fail)
        endpoint = f"127.0.0.1:{10 + self.calls}"
        self.running.append(endpoint)
        return endpoint

    def scale_in(self, service: str, version: str, endpoint: str) -> None:
        self.running.remove(endpoint)
        self.stopped.append(endpoint)


class Loop:
    """An SloController on a real control plane, fed the readings the test sets."""

    def __init__(self, cp: XdsServer, scaler: BlockingScalerFake) -> None:
        self.cp, self.scaler, self.reading = cp, scaler, BREACHED
        clock = itertools.count(1000)
        self.c = SloController(cp, "llm", scaler=scaler, read=lambda: self.reading,
                               clock=lambda: float(next(clock)))  # fmt: skip

    def tick(self, reading: Reading) -> dict[str, Any]:
        self.reading = reading
        return self.c.tick()

    def directions(self) -> list[str]:
        return [h["direction"] for h in self.c.status()["history"]]

    def endpoints(self) -> list[str]:
        return [str(e) for e in self.cp.mesh.services["llm"].versions["v1"].endpoints]

    def started(self) -> dict[str, Any]:
        """Its status once the start in flight has completed."""
        return eventually(lambda: (st := self.c.status())["pending"] is None and st, 20)


def mesh(metrics_urls: tuple[str, ...] = (), **slo: Any) -> Any:
    block = {"ttft_p99": "1s", "intervals": 1, "recover_intervals": 1, "min_requests": 0,
             "actions": ["scale_out"], **slo}  # fmt: skip
    v1 = {"endpoints": [], "metrics_urls": list(metrics_urls)}
    return parse_mesh({"services": {"llm": {"versions": {"v1": v1}, "slo": block}}})


@contextmanager
def loop_of(scaler: BlockingScalerFake, **slo: Any) -> Iterator[Loop]:
    with build_server(mesh(**slo), debounce=0.02) as cp:
        loop = Loop(cp, scaler)
        try:
            yield loop
        finally:
            scaler.go.set()
            loop.c.close()


def test_intervals_during_a_start_are_published_but_no_action_is_taken() -> None:
    scaler = BlockingScalerFake()
    # Two replicas may be added, and one met interval would undo: neither happens mid-start.
    with loop_of(scaler, max_replicas=2) as loop:
        loop.tick(BREACHED)  # returns while the replica is still starting
        st = loop.c.status()
        assert st["pending"]["version"] == "v1" and not st["pending"]["cancelled"]
        assert st["history"][0]["done"] == "starting a replica of v1"
        assert st["in_force"] == ["scale_out"] and st["replicas"] == [] and loop.endpoints() == []

        breached = loop.tick(BREACHED)
        assert loop.c.status()["last"] == breached and breached["deviation"] == 1.0
        assert breached["held"] == "a replica of v1 is starting"
        met = loop.tick(MET)
        assert loop.c.status()["last"] == met and met["deviation"] == -0.9
        assert loop.directions() == ["apply"] and scaler.calls == 1 and loop.c.decide.level == 1

        scaler.go.set()
        st = loop.started()
        assert st["replicas"] == [REPLICA] and loop.endpoints() == [REPLICA]
        assert loop.directions() == ["apply", "ready"]
        assert st["history"][1]["done"] == f"replica {REPLICA} added to v1"
        # Decisions resume on intervals measured with the replica serving.
        assert loop.tick(BREACHED)["held"] is None
        assert loop.directions() == ["apply", "ready", "apply"] and scaler.calls == 2


def test_the_counts_restart_when_the_start_completes() -> None:
    scaler = BlockingScalerFake()
    with loop_of(scaler, intervals=2, recover_intervals=2) as loop:
        loop.tick(BREACHED)
        loop.tick(BREACHED)  # the second breached interval in a row: scale out
        loop.tick(MET)  # measured while the replica starts: not counted
        scaler.go.set()
        loop.started()
        assert loop.tick(MET)["met_intervals"] == 1
        assert loop.directions() == ["apply", "ready"]  # one met interval is not yet an undo
        loop.tick(MET)
        assert loop.directions() == ["apply", "ready", "undo"]
        assert scaler.stopped == [REPLICA] and loop.endpoints() == []


def test_a_failed_start_is_recorded_with_its_reason_and_leaves_nothing_in_force() -> None:
    scaler = BlockingScalerFake(fail="no quota left")
    with loop_of(scaler) as loop:
        loop.tick(BREACHED)
        scaler.go.set()
        st = loop.started()
        assert loop.directions() == ["apply", "failed"]
        assert st["history"][1]["done"] == "scale-out failed: no quota left; not in force"
        assert st["level"] == 0 and st["in_force"] == [] and st["replicas"] == []
        assert loop.endpoints() == []
        loop.tick(BREACHED)  # still breached: the loop tries again
        assert loop.directions() == ["apply", "failed", "apply"] and scaler.calls == 2


def test_stopping_the_loops_during_a_start_stops_the_replica_it_produces() -> None:
    scaler, metrics = BlockingScalerFake(), Metrics()
    metrics.ttft_ms = 2000.0
    url = f"http://127.0.0.1:{metrics.server_port}/metrics"
    with build_server(mesh((url,)), debounce=0.02) as cp:
        loops = SloLoops(cp, scaler)  # not started: its loop is ticked here
        loop = loops.loops["llm"]
        loop.tick()
        stopping = threading.Thread(target=loops.stop)
        stopping.start()
        # stop() waits for the start; the replica is not added once it returns
        eventually(lambda: loop.status()["pending"]["cancelled"], 10, "the start cancelled")
        scaler.go.set()
        stopping.join(timeout=20)
        assert not stopping.is_alive()
        assert scaler.stopped == [REPLICA] and scaler.running == []
        assert loop.status()["replicas"] == [] and loop.status()["pending"] is None
        assert [str(e) for e in cp.mesh.services["llm"].versions["v1"].endpoints] == []
        last = loop.status()["history"][-1]
        assert (last["direction"], last["done"]) == (
            "stopped",
            f"replica {REPLICA} started after the loop was closed: stopped",
        )
    metrics.shutdown()


def test_undo_all_during_a_start_stops_its_replica_and_takes_everything_back() -> None:
    scaler = BlockingScalerFake()
    with loop_of(scaler) as loop:
        loop.tick(BREACHED)
        undoing = threading.Thread(target=loop.c.undo_all)
        undoing.start()
        eventually(lambda: loop.c.status()["pending"]["cancelled"], 10, "the start cancelled")
        scaler.go.set()
        undoing.join(timeout=20)
        assert not undoing.is_alive()
        st = loop.c.status()
        assert scaler.stopped == [REPLICA] and scaler.running == []
        assert st["level"] == 0 and st["replicas"] == [] and loop.endpoints() == []


def test_a_start_that_returned_before_close_is_added_then_stopped_by_it() -> None:
    scaler = BlockingScalerFake()
    with loop_of(scaler) as loop:
        loop.tick(BREACHED)
        scaler.go.set()
        loop.started()
        loop.c.close()
        assert scaler.stopped == [REPLICA] and loop.c.status()["replicas"] == []
        assert loop.endpoints() == []

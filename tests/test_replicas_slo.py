"""The SLO loop on replicas (issue 15): its level, actions in force and history live in the store
(`slo/<service>`, written with the leader's fence), so a new leader continues the loop where the
old one left it. Before, the new leader's loop started at level 0 with nothing in force and its
first interval took back the old leader's shedding, SLO breached or not. Real etcd, control
planes on it; the loop's readings are given (what callers saw is not what is tested here)."""

from __future__ import annotations

import uuid

import pytest

from tests.etcd_support import EtcdCluster, wait_for
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.replica.election import Election, NotLeader
from xds_server.replica.leader import FencedChanges, StoreSlo
from xds_server.replica.replication import Replication
from xds_server.server import XdsServer
from xds_server.slo.loop import Reading, SloController
from xds_server.store import EtcdStore, Fenced

DOC = {
    "services": {
        "llm": {
            "versions": {"v1": {"endpoints": ["127.0.0.1:9"]}},
            "slo": {"ttft_p99": "500ms", "intervals": 1, "recover_intervals": 2,
                    "actions": ["shed", "tighten_outlier"]},
        }
    },
    "tenants": {
        n: {"key_sha256": hash_key(n * 8), "allow": ["llm/*"], "priority": p}
        for n, p in (("gold", "high"), ("free", "low"))
    },
}  # fmt: skip
BREACHED = Reading(requests=100, success_rate=100.0, ttft_p99=2.0)
IN_BAND = Reading(requests=100, success_rate=100.0, ttft_p99=0.55)  # +10 %: neither way
MET = Reading(requests=100, success_rate=100.0, ttft_p99=0.1)


@pytest.fixture(scope="module")
def etcd():
    with EtcdCluster(1) as cluster:
        yield cluster


class Leader:
    """A replica's control plane, its election (led at once) and its SLO loop for llm."""

    def __init__(self, etcd: EtcdCluster, root: str, name: str) -> None:
        self.store = EtcdStore(etcd.endpoints, root=root, timeout=1.0)
        self.cp = build_server(parse_mesh(DOC), replication=Replication(self.store, name, DOC))
        self.cp.start()
        self.election = Election(self.store, name, ttl=2.0).start()
        assert self.election.wait(True, 10), f"{name} does not lead"
        self.reading = IN_BAND
        self.loop = SloController(FencedChanges(self.cp, self.election), "llm",
                                  read=lambda: self.reading,
                                  memory=StoreSlo(self.store, self.election))  # fmt: skip

    def tick(self, reading: Reading) -> None:
        self.reading = reading
        self.loop.tick()

    def close(self) -> None:
        self.election.stop(resign=True)
        self.cp.stop()
        self.store.close()


def shed(cp: XdsServer) -> tuple[str, ...]:
    return cp.mesh.services["llm"].slo_state.shed_tenants


def test_a_new_leader_continues_the_slo_loop_where_the_old_one_left_it(etcd):
    root = f"/t-{uuid.uuid4().hex}/"
    a = Leader(etcd, root, "a")
    b = None
    try:
        a.tick(BREACHED)  # one breached interval: shed the low-priority tenant
        assert a.loop.status()["level"] == 1 and shed(a.cp) == ("free",)
        a.election.stop(resign=True)  # a steps down; b takes office

        b = Leader(etcd, root, "b")
        status = b.loop.status()
        assert status["level"] == 1 and status["in_force"] == ["shed"], status
        assert [h["action"] for h in status["history"]] == ["shed"], status
        b.tick(IN_BAND)  # neither breached nor met: what is in force stays
        assert shed(b.cp) == ("free",)
        wait_for(lambda: shed(a.cp) == ("free",), 10)  # the other replica sees the same
        b.tick(BREACHED)  # the next action, from level 1
        assert b.cp.mesh.services["llm"].slo_state.outlier_tightened
        b.tick(MET)
        b.tick(MET)  # held twice: the last action is undone, the shedding stays
        assert not b.cp.mesh.services["llm"].slo_state.outlier_tightened
        assert shed(b.cp) == ("free",) and b.loop.status()["level"] == 1

        # The deposed leader's loop can no longer write its state (the fence).
        with pytest.raises((Fenced, NotLeader)):
            a.tick(BREACHED)
        assert b.store.get("slo/llm").json()["level"] == 1
    finally:
        for leader in (a, b):
            if leader is not None:
                leader.close()


def test_a_changed_slo_block_starts_the_loop_over(etcd):
    """A stored loop for other objectives is not adopted (level 0, nothing in force)."""
    root = f"/t-{uuid.uuid4().hex}/"
    a = Leader(etcd, root, "a")
    try:
        a.tick(BREACHED)
        doc = a.store.get("slo/llm").json()
        doc["slo"]["ttft_p99"] = 9.0  # as if the mesh's slo block had been different
        a.loop.memory.save("llm", doc)
        fresh = SloController(FencedChanges(a.cp, a.election), "llm", read=lambda: IN_BAND,
                              memory=StoreSlo(a.store, a.election))  # fmt: skip
        assert fresh.status()["level"] == 0 and fresh.status()["history"] == []
    finally:
        a.close()

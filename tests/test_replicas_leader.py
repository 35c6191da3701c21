"""The leader's work on replicas (issue 15): one replica runs the rollouts, its writes fenced;
when it dies mid-rollout another takes over within the lease TTL plus a few seconds and the
rollout continues from its step, with no failed call; a write with the old term's fence fails.
Real etcd, real Envoy, real gRPC upstreams."""

from __future__ import annotations

import contextlib
import time
import uuid

import pytest

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.etcd_support import EtcdCluster, Partition, wait_for
from tests.rollout_upstreams import Traffic, Upstream
from tests.test_replicas_sync import source
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.replica.election import Election
from xds_server.replica.leader import (
    FencedChanges,
    LeaderWork,
    StoreRollouts,
    import_rollouts,
    rollouts_of,
)
from xds_server.replica.replication import Replication
from xds_server.rollout.controller import TERMINAL, RolloutController
from xds_server.rollout.gates.sources import mesh_sources
from xds_server.store import EtcdStore, Fenced, FileStore, StoreUnavailable
from xds_server.store.state_file import RolloutStore

TTL = 2.0
SPEC = {
    "service": "llm",
    "stable": "v1",
    "canary": "v2",
    "steps": [10, 40, 70, 100],
    "interval": "1.5s",
    "threshold": 2,
    "ack_timeout": "10s",
    "gates": {"grpc_success_rate_min": 99.0, "min_requests": 5},
}


class Replica:
    """A control plane on the store, its election and its leader-only rollout controller."""

    def __init__(self, store: EtcdStore, name: str, doc: dict, sources, ttl: float = TTL) -> None:
        self.store = store
        self.cp = build_server(parse_mesh(doc), replication=Replication(store, name, doc))
        self.cp.start()
        self.election = Election(store, name, ttl=ttl, on_change=lambda up: self.work.changed(up))

        def start() -> RolloutController:
            changes = FencedChanges(self.cp, self.election)
            return RolloutController(
                changes, StoreRollouts(store, self.election), sources, poll_s=0.05
            )

        self.work = LeaderWork(self.election, start, lambda c: c.close())
        self.election.start()

    @property
    def controller(self) -> RolloutController | None:
        return self.work.handle

    def kill(self) -> None:
        """As a SIGKILL leaves it: nothing resigns; the lease ends by itself."""
        self.work.close()
        self.election.stop(resign=False)
        self.cp.stop()


@pytest.fixture(scope="module")
def etcd():
    with EtcdCluster(1) as cluster:
        yield cluster


def test_the_leader_dies_mid_rollout_and_the_other_replica_finishes_it(etcd):
    root = f"/t-{uuid.uuid4().hex}/"
    with contextlib.ExitStack() as stack:
        v1 = stack.enter_context(Upstream("v1"))
        v2 = stack.enter_context(Upstream("v2"))
        doc = source(v1.port, v2.port)
        stores = [stack.enter_context(EtcdStore(etcd.endpoints, root=root, timeout=0.5))
                  for _ in range(2)]  # fmt: skip
        admin = free_port()
        sources = mesh_sources([f"http://127.0.0.1:{admin}"])
        a, b = (Replica(s, n, doc, sources) for s, n in zip(stores, "ab", strict=True))
        for r in (a, b):
            stack.callback(r.kill)
        listen = free_port()
        boot = ads_bootstrap(
            "caller-0",
            xds_address=[("127.0.0.1", a.cp.grpc_port), ("127.0.0.1", b.cp.grpc_port)],
            outbound_port=listen,
            admin_port=admin,
        )
        stack.enter_context(EnvoyProcess(boot))
        t = stack.enter_context(Traffic(f"127.0.0.1:{listen}", authority="llm"))
        wait_for(lambda: t.replies["v1"] > 20, 20)
        leader = wait_for(lambda: [r for r in (a, b) if r.controller], 20)[0]
        other = b if leader is a else a
        assert other.controller is None and other.work.state == "following"
        term = leader.election.fence()
        leader.controller.start(SPEC)
        wait_for(lambda: rollouts_of(other.store)["llm"]["canary_weight"] >= 40, 30)
        step = rollouts_of(other.store)["llm"]["step"]
        leader.kill()
        killed = time.monotonic()
        wait_for(lambda: other.controller is not None, TTL + 5)
        took = time.monotonic() - killed
        rec = other.controller.status("llm")
        assert rec["step"] >= step, rec  # from its step, not from the start
        reason = rec["history"][-1]["reason"].lower()
        assert "restarted while progressing" in reason or rec["step"] > step, rec
        done = wait_for(lambda: (s := other.controller.status("llm"))["state"] in TERMINAL and s,
                        45)  # fmt: skip
        assert done["state"] == "Succeeded", done["message"]
        assert other.cp.mesh.services["llm"].route.weights == {"v1": 0, "v2": 100}
        assert min(h["canary_weight"] for h in done["history"][-3:]) >= 10
        t.__exit__(None, None, None)
        assert set(t.codes) == {"OK"}, t.codes
        assert t.replies["v1"] and t.replies["v2"]
        # The dead leader's term is over: a write with its fence is refused, nothing lands.
        with pytest.raises(Fenced, match="another term began"), other.cp.fenced(term):
            other.cp.set_weights("llm", {"v1": 100, "v2": 0}, timeout=1)
        assert other.cp.mesh.services["llm"].route.weights == {"v1": 0, "v2": 100}
        assert took < TTL + 5


def test_a_leader_partitioned_from_the_store_steps_down_and_catches_up_after(etcd):
    root = f"/t-{uuid.uuid4().hex}/"
    with contextlib.ExitStack() as stack:
        v1 = stack.enter_context(Upstream("v1"))
        v2 = stack.enter_context(Upstream("v2"))
        doc = source(v1.port, v2.port)
        link = stack.enter_context(Partition(etcd.endpoints[0]))
        sa = stack.enter_context(EtcdStore([link.endpoint], root=root, timeout=0.5))
        sb = stack.enter_context(EtcdStore(etcd.endpoints, root=root, timeout=0.5))
        sources = mesh_sources([])
        a = Replica(sa, "a", doc, sources)
        stack.callback(a.kill)
        wait_for(lambda: a.controller is not None, 20)  # a leads: it came first
        b = Replica(sb, "b", doc, sources)
        stack.callback(b.kill)
        listen = free_port()
        boot = ads_bootstrap("caller-0", xds_address=("127.0.0.1", a.cp.grpc_port),
                             outbound_port=listen)  # fmt: skip
        stack.enter_context(EnvoyProcess(boot))
        t = stack.enter_context(Traffic(f"127.0.0.1:{listen}", authority="llm"))
        wait_for(lambda: t.replies["v1"] > 20, 20)

        link.cut()
        wait_for(lambda: b.controller is not None, TTL + 5)
        assert not a.election.is_leader and a.controller is None
        assert a.work.state.startswith("paused"), a.work.state
        with pytest.raises(StoreUnavailable):  # nothing written from a stale view
            a.cp.set_weights("llm", {"v1": 0, "v2": 100}, timeout=1)
        assert b.cp.set_weights("llm", {"v1": 0, "v2": 100}, timeout=0) is not None
        calls = sum(t.codes.values())
        wait_for(lambda: sum(t.codes.values()) > calls + 50, 20)  # a's sidecar still served
        assert t.replies["v2"] == 0  # on the last config a had

        link.heal()
        before = t.replies["v2"]
        wait_for(lambda: t.replies["v2"] > before + 20, 20)  # a caught up from the store
        assert a.controller is None and b.controller is not None
        t.__exit__(None, None, None)
        assert set(t.codes) == {"OK"}, t.codes


def test_taking_office_is_announced_at_once_not_a_beat_later(etcd):
    # With istiod's 30 s lease a beat is 10 s: the leader's work started that much late.
    calls: list[bool] = []
    with EtcdStore(etcd.endpoints, root=f"/t-{uuid.uuid4().hex}/", timeout=1.0) as store:
        e = Election(store, "solo", ttl=30.0, on_change=calls.append).start()
        try:
            wait_for(lambda: e.is_leader, 5)
            wait_for(lambda: calls == [True], 2)
        finally:
            e.stop()


def test_rollouts_of_a_single_control_plane_are_imported_once(tmp_path):
    old = tmp_path / "rollouts.json"
    RolloutStore(old).save({"llm": {"state": "Progressing", "step": 2}})
    with FileStore(tmp_path / "state.json") as store:
        assert import_rollouts(store, old) == ["llm"]
        assert rollouts_of(store) == {"llm": {"state": "Progressing", "step": 2}}
        RolloutStore(old).save({"llm": {"state": "Paused", "step": 0}})
        assert import_rollouts(store, old) == []  # the store's are newer than the file
        assert rollouts_of(store)["llm"]["step"] == 2
    with FileStore(tmp_path / "other.json") as store:
        assert import_rollouts(store, tmp_path / "none.json") == []

"""Chaos on control-plane replicas (issue 15): two replicas on a 3-member etcd, a caller Envoy
listing both, real traffic. The leader killed mid-rollout (the other finishes it); an etcd
member killed (nothing visible); etcd quorum lost (the sidecars keep their config, the leader
steps down and its work pauses, changes are refused, nothing acts) and back (a leader again,
changes go through)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

import pytest

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.chaos.record import record
from tests.etcd_support import EtcdCluster, wait_for
from tests.rollout_upstreams import Traffic, Upstream
from tests.test_replicas_leader import SPEC, TTL, Replica
from tests.test_replicas_sync import source
from xds_server.replica.leader import rollouts_of
from xds_server.rollout.controller import TERMINAL
from xds_server.rollout.gates.sources import mesh_sources
from xds_server.store import EtcdStore, StoreUnavailable

LOAD = "calls back to back (5 ms pause) through a caller Envoy listing both replicas"


@contextlib.contextmanager
def replicas(cluster: EtcdCluster, ttl: float = TTL) -> Iterator[tuple[list[Replica], Traffic]]:
    root = f"/t-{uuid.uuid4().hex}/"
    with contextlib.ExitStack() as stack:
        v1 = stack.enter_context(Upstream("v1"))
        v2 = stack.enter_context(Upstream("v2"))
        doc = source(v1.port, v2.port)
        admin = free_port()
        sources = mesh_sources([f"http://127.0.0.1:{admin}"])
        reps = []
        for name in ("a", "b"):
            store = stack.enter_context(EtcdStore(cluster.endpoints, root=root, timeout=0.5))
            reps.append(Replica(store, name, doc, sources, ttl))
            stack.callback(reps[-1].kill)
        boot = ads_bootstrap(
            "caller-0",
            xds_address=[("127.0.0.1", r.cp.grpc_port) for r in reps],
            outbound_port=(listen := free_port()),
            admin_port=admin,
        )
        stack.enter_context(EnvoyProcess(boot))
        t = stack.enter_context(Traffic(f"127.0.0.1:{listen}", authority="llm"))
        wait_for(lambda: t.replies["v1"] > 20, 20)
        wait_for(lambda: [r for r in reps if r.controller], 20)
        yield reps, t


def leader_of(reps: list[Replica], ttl: float = TTL) -> tuple[Replica, Replica]:
    leader = wait_for(lambda: [r for r in reps if r.controller], ttl + 5)[0]
    return leader, next(r for r in reps if r is not leader)


@pytest.fixture
def cluster():
    with EtcdCluster(3) as c:
        yield c


def test_leader_killed_mid_rollout_the_other_replica_finishes_it(cluster):
    started, passed, details = time.monotonic(), False, {}
    t = None
    try:
        with replicas(cluster) as (reps, t):
            leader, other = leader_of(reps)
            leader.controller.start(SPEC)
            wait_for(lambda: rollouts_of(other.store)["llm"]["canary_weight"] >= 40, 30)
            step = rollouts_of(other.store)["llm"]["step"]
            leader.kill()
            killed = time.monotonic()
            wait_for(lambda: other.controller is not None, TTL + 5)
            details["takeover_s"] = round(time.monotonic() - killed, 2)
            details["lease_ttl_s"] = TTL
            resumed = other.controller.status("llm")["step"]
            assert resumed >= step
            done = wait_for(lambda: (s := other.controller.status("llm"))["state"] in TERMINAL
                            and s, 45)  # fmt: skip
            assert done["state"] == "Succeeded", done["message"]
            t.__exit__(None, None, None)
            details["resumed_at_step"] = f"{resumed} (killed at {step})"
        assert set(t.codes) == {"OK"}, t.codes
        passed = True
    finally:
        record(
            "test_leader_killed_mid_rollout_the_other_replica_finishes_it",
            "Control-plane leader killed mid-rollout (2 replicas on 3-member etcd)",
            load=LOAD,
            faults=["the leading replica stopped dead at step 40 % (no resign: its lease ends)"],
            by_status=dict(t.codes) if t else {},
            allowed_lost=sum(n for c, n in (t.codes if t else {}).items() if c != "OK"),
            recovery_s=details.get("takeover_s"),
            passed=passed,
            started=started,
            **details,
        )


def test_etcd_member_killed_then_quorum_lost_and_back(cluster):
    started, passed, details = time.monotonic(), False, {}
    t = None
    try:
        # A lease longer than an etcd leader election (istiod's is 30 s): the leader keeps it
        # through one member's death.
        with replicas(cluster, ttl=6.0) as (reps, t):
            leader, other = leader_of(reps, 6.0)
            term = leader.election.fence().term
            # One member down (the raft leader, the worst one): nothing visible.
            raft = cluster.raft_leader()
            cluster.kill(raft)
            r = other.cp.set_weights("llm", {"v1": 50, "v2": 50}, timeout=15)
            assert r.ok and r.acked == ["caller-0"], r
            assert leader.election.is_leader and leader.election.fence().term == term
            wait_for(lambda: t.replies["v2"] > 20, 20)
            # A second member down: no quorum.
            lost = time.monotonic()
            cluster.kill(next(i for i in range(3) if i != raft))
            wait_for(lambda: not any(x.election.is_leader for x in reps), 6.0 + 5)
            wait_for(lambda: all(x.work.state.startswith("paused") or x.work.state ==
                                 "following" for x in reps), 10)  # fmt: skip
            details["step_down_s"] = round(time.monotonic() - lost, 2)
            with pytest.raises(StoreUnavailable):  # after its 5 s of retries
                other.cp.set_weights("llm", {"v1": 0, "v2": 100}, timeout=5)
            calls = sum(t.codes.values())
            wait_for(lambda: sum(t.codes.values()) > calls + 50, 20)  # still served
            assert leader.cp.mesh.services["llm"].route.weights == {"v1": 50, "v2": 50}
            # Quorum back: a leader again, changes go through.
            back = time.monotonic()
            for i in range(3):
                if cluster.procs[i] is None:
                    cluster.restart(i)
            leader, other = leader_of(reps, 6.0)
            details["leader_again_s"] = round(time.monotonic() - back, 2)
            wait_for(lambda: other.work.state == "following", 10)  # no longer "paused: ..."
            r = wait_for(lambda: _try(other, {"v1": 0, "v2": 100}), 20)
            assert r.ok and r.acked == ["caller-0"], r
            before = t.replies["v2"]
            wait_for(lambda: t.replies["v2"] > before + 20, 20)
            t.__exit__(None, None, None)
        assert set(t.codes) == {"OK"}, t.codes
        passed = True
    finally:
        record(
            "test_etcd_member_killed_then_quorum_lost_and_back",
            "etcd member killed, then quorum lost and back (2 replicas on 3-member etcd)",
            load=LOAD,
            faults=[
                "etcd raft leader SIGKILLed (weights changed meanwhile)",
                "a second member SIGKILLed: no quorum (a change attempted)",
                "both members restarted",
            ],
            by_status=dict(t.codes) if t else {},
            allowed_lost=sum(n for c, n in (t.codes if t else {}).items() if c != "OK"),
            recovery_s=details.get("leader_again_s"),
            passed=passed,
            started=started,
            **details,
        )


def _try(r: Replica, weights: dict[str, int]):
    try:
        return r.cp.set_weights("llm", weights, timeout=15)
    except StoreUnavailable:
        return None

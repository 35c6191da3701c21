"""Leader election on the store (issue 15): one candidate leads; a resigned, killed or
partitioned leader is replaced within its lease TTL plus a few seconds; the deposed leader has
stepped down by then and its fenced writes fail. Real etcd; the file store for one process."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.etcd_support import EtcdCluster, Partition, candidate_process, wait_for
from xds_server.replica.election import Election, NotLeader, current_leader
from xds_server.store import EtcdStore, Fenced, FileStore, Store

TTL = 2.0  # seconds; istiod's is 30 (the default)
TAKEOVER = TTL + 5  # the most a takeover may take here


@pytest.fixture(scope="module")
def etcd():
    with EtcdCluster(1) as cluster:
        yield cluster


def etcd_store(cluster: EtcdCluster, root: str, endpoints: list[str] | None = None) -> EtcdStore:
    return EtcdStore(endpoints or cluster.endpoints, root=root, timeout=1.0)


@pytest.fixture(params=["file", "etcd"])
def store(request, tmp_path):
    if request.param == "file":
        s: Store = FileStore(tmp_path / "state.json")
    else:
        s = etcd_store(request.getfixturevalue("etcd"), f"/t-{uuid.uuid4().hex}/")
    yield s
    s.close()


def test_one_of_two_candidates_leads_until_it_resigns(store):
    calls: dict[str, list[bool]] = {"r1": [], "r2": []}
    e1, e2 = (
        Election(store, name, ttl=TTL, info={"admin": f"https://{name}:18001"},
                 on_change=calls[name].append).start()
        for name in ("r1", "r2")
    )  # fmt: skip
    try:
        first = wait_for(lambda: [e for e in (e1, e2) if e.is_leader])
        assert len(first) == 1
        leader, other = (e1, e2) if first[0] is e1 else (e2, e1)
        term = leader.fence().term
        with pytest.raises(NotLeader, match=f"{other.candidate} does not lead"):
            other.fence()
        wait_for(lambda: other.leader() is not None)
        seen = current_leader(store)
        assert (seen.id, seen.term) == (leader.candidate, term)
        assert seen.info == {"admin": f"https://{leader.candidate}:18001"}
        assert other.leader() == seen == leader.leader()
        assert other.status()["leader"]["id"] == leader.candidate
        assert not other.status()["leading"] and leader.status()["leading"]
        # It keeps office past its TTL: the keep-alives work, and nobody else campaigns in.
        time.sleep(TTL * 1.5)
        assert leader.is_leader and not other.is_leader
        assert current_leader(store).term == term
        leader.stop()  # resigns: the other takes office without waiting for the lease
        assert other.wait(True, timeout=TTL)
        assert not leader.is_leader
        assert other.fence().term > term
        assert current_leader(store).id == other.candidate
        assert calls[leader.candidate] == [True, False]
        assert calls[other.candidate] == [True]
    finally:
        e1.stop()
        e2.stop()


def test_a_partitioned_leader_steps_down_is_replaced_and_fenced(etcd):
    root = f"/t-{uuid.uuid4().hex}/"
    with Partition(etcd.endpoints[0]) as link:
        s1 = etcd_store(etcd, root, [link.endpoint])  # r1 reaches etcd through the link only
        s2 = etcd_store(etcd, root)
        e1 = Election(s1, "r1", ttl=TTL).start()
        try:
            assert e1.wait(True, timeout=10)
            e2 = Election(s2, "r2", ttl=TTL).start()
            wait_for(lambda: e2.leader() is not None and e2.leader().id == "r1")
            fence = e1.fence()
            rev = s1.put("rollouts/llm", b"step 1 by r1", revision=0, fence=fence)

            link.cut()  # r1 can no longer renew its lease
            assert e1.wait(False, timeout=TTL + 1.5), "r1 kept leading past its lease"
            assert e2.wait(True, timeout=TAKEOVER), "r2 did not take over"
            assert not e1.is_leader  # never two leaders
            assert e2.fence().term > fence.term

            link.heal()
            with pytest.raises(Fenced, match=f"created at revision {fence.term}"):
                s1.put("rollouts/llm", b"step 2 by r1", revision=rev, fence=fence)
            assert s2.get("rollouts/llm").value == b"step 1 by r1"
            # Back in touch, r1 follows the new leader instead of campaigning against it.
            wait_for(lambda: e1.status()["leader"] and e1.status()["leader"]["id"] == "r2")
            assert e2.is_leader and not e1.is_leader
        finally:
            e1.stop()
            e2.stop()


def test_a_killed_leader_is_replaced_within_its_ttl(etcd):
    root = f"/t-{uuid.uuid4().hex}/"
    s2 = etcd_store(etcd, root)
    with candidate_process(etcd.endpoints, root, "r1", TTL) as (proc, term):
        e2 = Election(s2, "r2", ttl=TTL).start()
        try:
            wait_for(lambda: e2.leader() is not None and e2.leader().id == "r1")
            proc.kill()  # no resignation: its lease must run out
            assert e2.wait(True, timeout=TAKEOVER)
            assert e2.fence().term > term
            assert current_leader(s2).id == "r2"
        finally:
            e2.stop()

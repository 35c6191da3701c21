"""Quarantines on replicas (issue 15): a class tripped by one replica's callers (outcomes from
its sidecars' access logs) is written to the store (`isolation/<service>/<key>`) and quarantined
at every replica; a release by hand on another replica lifts it everywhere; two replicas that
trip one class at once keep one decision. Before, each replica decided alone and only its own
sidecars routed the class away. Real etcd, control planes on it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.etcd_support import EtcdCluster, wait_for
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.replica.replication import Replication
from xds_server.server import XdsServer
from xds_server.slo.quarantine import Isolation, SharedQuarantine
from xds_server.store import EtcdStore

# Times real processes against its own baseline or a deadline: not beside another test (-n 2).
pytestmark = pytest.mark.alone

POISON = "00000000deadbeef"
DOC = {
    "services": {
        "llm": {
            "versions": {
                "v1": {"endpoints": ["127.0.0.1:1001"]},
                "q": {"endpoints": ["127.0.0.1:1002"]},
            },
            "route": {"weights": {"v1": 100, "q": 0}},
            "isolation": {"error_rate": "50%", "window": "10s", "min_requests": 4,
                          "cooldown": "60s"},
        }
    }
}  # fmt: skip


@pytest.fixture(scope="module")
def etcd():
    with EtcdCluster(1) as cluster:
        yield cluster


@pytest.fixture
def replicas(etcd, tmp_path) -> Iterator[list[XdsServer]]:
    root = f"/t-{uuid.uuid4().hex}/"
    stores = [EtcdStore(etcd.endpoints, root=root, timeout=1.0) for _ in range(2)]
    cps = [
        build_server(parse_mesh(DOC), isolation_store=str(tmp_path / f"iso-{n}.json"),
                     replication=Replication(s, n, DOC)).start()
        for n, s in zip("ab", stores, strict=True)
    ]  # fmt: skip
    yield cps
    for cp in cps:
        cp.stop()
    for s in stores:
        s.close()


def quarantined(cp: XdsServer) -> list[str]:
    """The classes the routes this replica serves send to the quarantine pool."""
    return [q.key for q in cp.isolation.overlay(cp.mesh).services["llm"].quarantined]


def trip(cp: XdsServer) -> None:
    for _ in range(4):
        cp.isolation.observe("llm", POISON, True, reason="a poison prompt")


def test_a_class_tripped_at_one_replica_is_quarantined_at_every_replica(replicas):
    a, b = replicas
    trip(a)
    assert quarantined(a) == [POISON]
    wait_for(lambda: quarantined(b) == [POISON], 10)
    (t,) = b.isolation.status()["llm"]["quarantined"]
    assert t["state"] == "open" and "4 of 4 calls failed" in t["why"], t

    b.isolation.release("llm", POISON)  # by hand, on the other replica
    wait_for(lambda: quarantined(a) == [], 10)
    assert quarantined(b) == []


def test_two_replicas_tripping_one_class_at_once_keep_one_decision(replicas):
    a, b = replicas
    trip(a)
    trip(b)
    store = b.replication.store
    entries = wait_for(lambda: store.list("isolation/")[0], 10)
    assert [e.key for e in entries] == [f"isolation/llm/{POISON}"]
    stored = entries[0].json()["since"]

    def since(cp: XdsServer) -> list[float]:
        return [t["since"] for t in cp.isolation.status()["llm"]["quarantined"]]

    # Both take the stored decision (the later writer's own is dropped), one route each.
    wait_for(lambda: since(a) == since(b) == [stored], 10)
    assert quarantined(a) == quarantined(b) == [POISON]


def test_a_class_tripped_here_while_another_replicas_decision_comes_in_keeps_that_decision(
    etcd,
):
    """The race behind a red CI run: b trips the class while its sync is reading a's decision
    of it from the store. b's own decision was made without a's, so it is written over the
    revision b had (none) and loses; before, b wrote it over the revision it had just read and
    replaced a's."""
    mesh = parse_mesh(DOC)
    root = f"/t-{uuid.uuid4().hex}/"
    stores = [EtcdStore(etcd.endpoints, root=root, timeout=1.0) for _ in range(2)]
    try:
        a, b = (Isolation(lambda: mesh) for _ in range(2))
        a.share(SharedQuarantine(stores[0]))
        shared_b = SharedQuarantine(stores[1])
        b.share(shared_b)
        for _ in range(4):
            a.observe("llm", POISON, True, reason="at a")
        a.sync()
        (stored,) = stores[0].list("isolation/")[0]

        read = shared_b.exchange

        def tripped_while_reading(changes):
            out = read(changes)
            for _ in range(4):
                assert b.observe("llm", POISON, True, reason="at b") in ("trip", None)
            return out

        shared_b.exchange = tripped_while_reading
        b.sync()  # takes nothing of a's for the class: b changed it meanwhile
        shared_b.exchange = read
        b.sync()  # b's decision goes out, loses, and b takes a's
        (after,) = stores[1].list("isolation/")[0]
        assert (after.revision, after.json()["why"]) == (stored.revision, stored.json()["why"])
        assert [t["why"] for t in b.status()["llm"]["quarantined"]] == [stored.json()["why"]]
    finally:
        for s in stores:
            s.close()

"""The state store's contract (issue 15), on both stores: the local file and a real etcd.
Writes compare revisions (a stale writer is refused, never last-writer-wins), transactions are
all or nothing, watches replay every change in order, keys bound to a lease go with it, and a
write fenced by an ended term fails."""

from __future__ import annotations

import threading
import uuid

import pytest

from tests.etcd_support import EtcdCluster
from xds_server.store import (
    Check,
    Conflict,
    Delete,
    EtcdStore,
    Fence,
    Fenced,
    FileStore,
    LeaseLost,
    Put,
    Store,
)


@pytest.fixture(scope="module")
def etcd():
    with EtcdCluster(1) as cluster:
        yield cluster


@pytest.fixture(params=["file", "etcd"])
def store(request, tmp_path):
    if request.param == "file":
        s: Store = FileStore(tmp_path / "state.json")
    else:  # a root of its own: tests share the cluster, never each other's keys
        s = EtcdStore(request.getfixturevalue("etcd").endpoints, root=f"/t-{uuid.uuid4().hex}/")
    yield s
    s.close()


def test_a_stale_writer_is_refused(store):
    first = store.put("rollouts/llm", b'{"step": 0}', revision=0)
    # Two replicas read the record at `first`; one writes, the other's write must fail.
    ours = store.put("rollouts/llm", b'{"step": 1}', revision=first)
    with pytest.raises(Conflict) as e:
        store.put("rollouts/llm", b'{"step": 5}', revision=first)
    assert (e.value.key, e.value.expected, e.value.actual) == ("rollouts/llm", first, ours)
    assert f"written at revision {ours}, expected {first}" in str(e.value)
    entry = store.get("rollouts/llm")
    assert (entry.value, entry.revision, entry.created) == (b'{"step": 1}', ours, first)


def test_create_if_absent_refuses_an_existing_key(store):
    rev = store.put("mesh", b"a", revision=0)
    with pytest.raises(Conflict, match=r"exists .*expected it absent") as e:
        store.put("mesh", b"b", revision=0)
    assert (e.value.expected, e.value.actual) == (0, rev)
    assert store.get("mesh").value == b"a"


def test_a_delete_needs_the_current_revision(store):
    old = store.put("slo/llm", b"1", revision=0)
    new = store.put("slo/llm", b"2", revision=old)
    with pytest.raises(Conflict):
        store.delete("slo/llm", revision=old)
    assert store.get("slo/llm").value == b"2"
    store.delete("slo/llm", revision=new)
    assert store.get("slo/llm") is None
    with pytest.raises(Conflict, match="deleted; expected it as written"):
        store.put("slo/llm", b"3", revision=new)


def test_a_transaction_is_all_or_nothing(store):
    a = store.put("live/a", b"1", revision=0)
    b = store.put("live/b", b"1", revision=0)
    store.put("live/b", b"2", revision=b)  # live/b moved on
    with pytest.raises(Conflict) as e:
        store.txn(
            [Check("live/a", revision=a), Check("live/b", revision=b)],
            [Put("live/a", b"x"), Delete("live/b"), Put("live/c", b"x")],
        )
    assert e.value.key == "live/b"
    assert [(x.key, x.value) for x in store.list("live/")[0]] == [
        ("live/a", b"1"),
        ("live/b", b"2"),
    ]
    rev = store.txn([Check("live/a", revision=a)], [Put("live/a", b"y"), Put("live/c", b"y")])
    entries, at = store.list("live/")
    assert at == rev
    assert {x.key: (x.value, x.revision) for x in entries if x.key != "live/b"} == {
        "live/a": (b"y", rev),
        "live/c": (b"y", rev),
    }


def test_list_gives_only_the_prefix_in_key_order(store):
    for key in ("isolation/llm/b", "isolation/llm/a", "isolation/llm2/a", "isolationx", "slo/llm"):
        store.put(key, key.encode(), revision=0)
    entries, rev = store.list("isolation/llm/")
    assert [e.key for e in entries] == ["isolation/llm/a", "isolation/llm/b"]
    assert rev == store.revision() >= max(e.revision for e in entries)


def test_a_watch_sees_every_change_in_order(store):
    _, start = store.list("rollouts/")
    watch = store.watch("rollouts/", start + 1)
    expected = []

    def write() -> None:
        revs: dict[str, int] = {}
        for i in range(12):
            key = f"rollouts/s{i % 3}"
            if i % 4 == 3:
                store.delete(key, revision=revs.pop(key))
                expected.append(("delete", key, b""))
            else:
                revs[key] = store.put(key, str(i).encode(), revision=revs.get(key, 0))
                expected.append(("put", key, str(i).encode()))
            store.put(f"slo/x{i}", b"not watched", revision=0)

    writer = threading.Thread(target=write)
    writer.start()
    seen = []
    while len(seen) < 12:
        ev = watch.get(timeout=10)
        assert ev is not None, f"watch stalled after {seen}"
        seen.append(ev)
    writer.join()
    assert watch.get(timeout=0.3) is None  # nothing outside the prefix
    watch.close()
    assert [(e.kind, e.key, e.value) for e in seen] == expected
    revs = [e.revision for e in seen]
    assert revs == sorted(revs) and len(set(revs)) == 12
    # A watch from the first revision replays the same history.
    with store.watch("rollouts/", revs[0]) as again:
        assert [again.get(timeout=10) for _ in range(12)] == seen


def test_keys_bound_to_a_lease_go_with_it(store):
    lease = store.grant(30)
    assert store.keepalive(lease) > 0
    rev = store.put("replicas/r1", b"up", revision=0, lease=lease)
    assert store.get("replicas/r1").lease == lease
    with store.watch("replicas/", rev + 1) as watch:
        store.revoke(lease)
        ev = watch.get(timeout=10)
    assert (ev.kind, ev.key) == ("delete", "replicas/r1")
    assert store.get("replicas/r1") is None
    with pytest.raises(LeaseLost):
        store.keepalive(lease)
    with pytest.raises(LeaseLost):
        store.put("replicas/r1", b"up", revision=0, lease=lease)
    store.revoke(lease)  # again: no error


def test_a_fenced_write_fails_once_the_term_ended(store):
    old_lease = store.grant(30)
    term = store.put("leader", b"r1", revision=0, lease=old_lease)
    fence = Fence("leader", term)
    rev = store.put("rollouts/llm", b"step 1 by r1", revision=0, fence=fence)
    store.revoke(old_lease)  # r1's term ends; r2 takes office
    new_term = store.put("leader", b"r2", revision=0, lease=store.grant(30))
    assert new_term > term
    with pytest.raises(Fenced, match=rf"created at revision {term} .*now at {new_term}"):
        store.put("rollouts/llm", b"step 2 by r1", revision=rev, fence=fence)
    with pytest.raises(Fenced):
        store.delete("rollouts/llm", revision=rev, fence=fence)
    assert store.get("rollouts/llm").value == b"step 1 by r1"
    store.put("rollouts/llm", b"step 2 by r2", revision=rev, fence=Fence("leader", new_term))
    assert store.get("rollouts/llm").value == b"step 2 by r2"

"""What a replica reads from the store is checked like an admin request: a document nested
50,000 deep or a `live/*` or `faults` of the wrong shape is refused, naming its key and field; the
replica keeps serving the last good version, says it is not ready (and why) while the store
holds the bad document, and stages the next good edit. On a real etcd and a real
`meshlm xds-server` replica."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.etcd_support import EtcdCluster, wait_for
from tests.test_health_control_plane import get, started  # noqa: F401 (a fixture)
from tests.test_replicas_cli import Replica, env  # noqa: F401 (a fixture)
from xds_server.replica.leader import StoreRollouts
from xds_server.slo.quarantine import SharedQuarantine
from xds_server.store import EtcdStore, Put, encode
from xds_server.store.base import decode


def readyz(r: Replica) -> tuple[int, dict]:
    try:
        return get(r.admin + "/readyz")
    except OSError:
        return 0, {}


def test_a_bad_document_in_the_store_is_refused_and_the_watch_lives_on(
    tmp_path,
    env,  # noqa: F811
    started,  # noqa: F811
):
    with EtcdCluster(1) as etcd:
        root = f"t-{uuid.uuid4().hex}"
        url = f"etcd://{etcd.endpoints[0]}/{root}"
        started.append(r := Replica(tmp_path, env, "r1", "--store", url, "--leader-ttl", "2"))
        wait_for(lambda: readyz(r)[0] == 200, 30)
        store = EtcdStore(etcd.endpoints, root=f"/{root}/")
        good_mesh = store.get("mesh").value
        live = store.get("live/llm").json()

        deep = b'{"source": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
        store.txn([], [Put("mesh", deep)])
        _, doc = wait_for(lambda: (got := readyz(r))[0] == 503 and got, 20)
        assert "mesh" in doc["reason"] and "nested" in doc["reason"], doc

        store.txn([], [Put("live/llm", encode({**live, "slo_state": [1]}))])
        _, doc = wait_for(
            lambda: (got := readyz(r))[0] == 503 and "live/llm" in got[1]["reason"] and got, 20
        )
        assert "live/llm.slo_state" in doc["reason"], doc
        assert r.proc.poll() is None

        store.txn([], [Put("mesh", good_mesh)])
        rev = store.txn([], [Put("live/llm", encode({**live, "weights": {"v1": 0, "v2": 100}}))])
        _, doc = wait_for(
            lambda: (got := readyz(r))[0] == 200 and got[1]["store_revision"] >= rev and got, 20
        )
        assert "reason" not in doc, doc
        _, state = r.call("GET", "/dashboard/state")
        assert state["services"]["llm"]["weights"] == {"v1": 0, "v2": 100}, state

        # The faults document: a wrong shape is refused like any other; a fault the mesh can
        # no longer take (its version is gone) is left out alone, the replica still ready.
        store.txn([], [Put("faults", encode({"faults": "down"}))])
        _, doc = wait_for(lambda: (got := readyz(r))[0] == 503 and got, 20)
        assert "faults: expected {faults: [...]}" in doc["reason"], doc
        down = {"name": "down", "service": "llm", "abort": {"grpc_status": 14}}
        gone = {"name": "gone", "service": "llm", "version": "v9", "delay": {"fixed_delay": "1s"}}
        rev = store.txn([], [Put("faults", encode({"faults": [down, gone]}))])
        wait_for(lambda: (got := readyz(r))[0] == 200 and got[1]["store_revision"] >= rev, 20)
        _, listed = r.call("GET", "/v1/faults")
        assert [f["name"] for f in listed["faults"]] == ["down"], listed


@pytest.mark.parametrize(
    "value",
    [b"[" * 50_000 + b"]" * 50_000, b'{"a": ' * 100 + b"1" + b"}" * 100, b"x" * (5 << 20)],
    ids=["50000-deep", "100-deep", "5MiB"],
)
def test_decode_refuses_a_value_past_its_bounds_naming_the_key(value: bytes) -> None:
    with pytest.raises(ValueError, match=r"^live/llm: "):
        decode(value, "live/llm")


def test_decode_counts_brackets_inside_strings_as_text() -> None:
    assert decode(json.dumps({"s": "[" * 1000}).encode(), "k") == {"s": "[" * 1000}


def test_leader_and_quarantine_documents_are_checked_too() -> None:
    """rollouts/* (read when a replica takes office) and isolation/* (read by every replica):
    a value nested 50,000 deep or of the wrong types is logged and left out, never raised."""
    with EtcdCluster(1) as etcd:
        store = EtcdStore(etcd.endpoints, root=f"/t-{uuid.uuid4().hex}/")
        deep = b"[" * 50_000 + b"]" * 50_000
        good = {"service": "llm", "key": "k", "state": "open", "since": 1.0, "why": "5xx",
                "cooldown": 5.0, "reopen_at": 2.0}  # fmt: skip
        store.txn([], [
            Put("rollouts/llm", deep),
            Put("rollouts/other", encode({"service": "other", "spec": [1]})),
            Put("isolation/llm/a", deep),
            Put("isolation/llm/b", encode({**good, "key": ["b"]})),
            Put("isolation/llm/c", encode({**good, "key": "k"})),  # under another's key
            Put("isolation/llm/k", encode(good)),
        ])  # fmt: skip
        assert StoreRollouts(store, None).load() == {}
        shared, _ = SharedQuarantine(store).exchange({})
        assert list(shared) == [("llm", "k")]

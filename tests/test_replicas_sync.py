"""Control-plane replicas on a store (issue 15): two replicas on one real etcd, each serving a
real Envoy; a change made through one is ACKed by the sidecars of both; a replica joining takes
the store's state, not its own mesh file's; a caller sidecar listing both replicas fails over
when its replica dies, with no failed call."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.etcd_support import EtcdCluster, wait_for
from tests.rollout_upstreams import Traffic, Upstream
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.replica.replication import Replication
from xds_server.server import XdsServer
from xds_server.store import EtcdStore, FileStore


def source(v1: int, v2: int, weights: tuple[int, int] = (100, 0)) -> dict:
    return {
        "control_plane": {"debounce": "20ms"},
        "services": {
            "llm": {
                "versions": {
                    "v1": {"endpoints": [f"127.0.0.1:{v1}"]},
                    "v2": {"endpoints": [f"127.0.0.1:{v2}"]},
                },
                "route": {"weights": {"v1": weights[0], "v2": weights[1]}},
            }
        },
    }


@pytest.fixture(scope="module")
def etcd():
    with EtcdCluster(1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def upstreams():
    with Upstream("v1") as v1, Upstream("v2") as v2:
        yield v1, v2


@contextlib.contextmanager
def replica(store, name: str, doc: dict, port: int = 0) -> Iterator[XdsServer]:
    cp = build_server(parse_mesh(doc), replication=Replication(store, name, doc)).start(port)
    try:
        yield cp
    finally:
        cp.stop()


@contextlib.contextmanager
def caller(node: str, *cps: XdsServer) -> Iterator[str]:
    """A caller-side Envoy whose bootstrap lists `cps`; yields its listener address."""
    listen = free_port()
    boot = ads_bootstrap(
        node, xds_address=[("127.0.0.1", cp.grpc_port) for cp in cps], outbound_port=listen
    )
    with EnvoyProcess(boot):
        yield f"127.0.0.1:{listen}"


def routed(target: str, n: int = 20) -> dict[str, int]:
    t = Traffic(target, authority="llm")
    try:
        t.send(n)
        return dict(t.replies) if not set(t.codes) - {"OK"} else {"failed": dict(t.codes)}
    finally:
        t.channel.close()


def connected(cp: XdsServer) -> set[str]:
    return {n for n, d in cp.syncz()["nodes"].items() if d["connected"]}


def etcd_store(cluster: EtcdCluster, root: str) -> EtcdStore:
    return EtcdStore(cluster.endpoints, root=root, timeout=1.0)


@dataclass
class Pair:
    """Two replicas on one store root, each with its caller sidecar."""

    a: XdsServer
    b: XdsServer
    via_a: str
    via_b: str
    store: EtcdStore


@contextlib.contextmanager
def two_replicas(cluster: EtcdCluster, upstreams) -> Iterator[Pair]:
    v1, v2 = upstreams
    root = f"/t-{uuid.uuid4().hex}/"
    doc = source(v1.port, v2.port)
    with (
        etcd_store(cluster, root) as sa,
        etcd_store(cluster, root) as sb,
        replica(sa, "a", doc) as a,
        replica(sb, "b", doc) as b,
        caller("caller-a", a) as via_a,
        caller("caller-b", b) as via_b,
    ):
        wait_for(lambda: connected(a) == {"caller-a"} and connected(b) == {"caller-b"}, 20)
        yield Pair(a, b, via_a, via_b, sa)


def test_a_change_through_one_replica_is_acked_by_the_sidecars_of_both(etcd, upstreams):
    with two_replicas(etcd, upstreams) as pair:
        a, b, via_a, via_b = pair.a, pair.b, pair.via_a, pair.via_b
        wait_for(lambda: routed(via_a) == {"v1": 20} and routed(via_b) == {"v1": 20}, 20)
        r = a.set_weights("llm", {"v1": 0, "v2": 100}, timeout=15)
        assert r.ok, r
        assert r.acked == ["caller-a", "caller-b"] and r.revision > 0
        # Returned only once both held it: no wait needed before reading either.
        assert routed(via_b) == {"v2": 20}
        assert routed(via_a) == {"v2": 20}
        assert b.mesh.services["llm"].route.weights == {"v1": 0, "v2": 100}


def test_a_replica_joining_takes_the_stores_state_not_its_mesh_files(etcd, upstreams):
    v1, v2 = upstreams
    root = f"/t-{uuid.uuid4().hex}/"
    with etcd_store(etcd, root) as sa, etcd_store(etcd, root) as sb:
        with replica(sa, "a", source(v1.port, v2.port)) as a:
            assert a.set_weights("llm", {"v1": 30, "v2": 70}, timeout=5).ok
            # A stale file (all to v1) on the second replica must not win over the store.
            with replica(sb, "b", source(v1.port, v2.port)) as b:
                assert b.mesh.services["llm"].route.weights == {"v1": 30, "v2": 70}
                b.add_endpoint("llm", "v2", "127.0.0.1:1", timeout=0)
                wait_for(lambda: len(a.mesh.services["llm"].versions["v2"].endpoints) == 2)
        # A mesh file applied through a replica reaches the other (tenants, new versions...).
        new = source(v1.port, v2.port, (50, 50))
        with replica(sa, "a", source(v1.port, v2.port)) as a, replica(sb, "b", new) as b:
            new["services"]["llm"]["versions"]["v3"] = {"endpoints": ["127.0.0.1:2"]}
            new["services"]["llm"]["route"]["weights"]["v3"] = 0
            b.apply_mesh(parse_mesh(new), source=new, timeout=0)
            wait_for(lambda: "v3" in a.mesh.services["llm"].versions)
            assert a.mesh.services["llm"].route.weights == {"v1": 50, "v2": 50, "v3": 0}


def test_a_sidecar_fails_over_to_another_replica_with_no_failed_call(etcd, upstreams):
    v1, v2 = upstreams
    root = f"/t-{uuid.uuid4().hex}/"
    doc = source(v1.port, v2.port)
    port_b = free_port()
    with contextlib.ExitStack() as stack:
        sa, sb = (stack.enter_context(etcd_store(etcd, root)) for _ in range(2))
        a = build_server(parse_mesh(doc), replication=Replication(sa, "a", doc)).start()
        stack.callback(a.stop)
        # The bootstrap lists both; b is not up yet, so the sidecar's stream is a's.
        listen = free_port()
        boot = ads_bootstrap(
            "caller-0",
            xds_address=[("127.0.0.1", a.grpc_port), ("127.0.0.1", port_b)],
            outbound_port=listen,
        )
        stack.enter_context(EnvoyProcess(boot))
        t = stack.enter_context(Traffic(f"127.0.0.1:{listen}", authority="llm"))
        wait_for(lambda: "caller-0" in connected(a) and t.replies["v1"] > 20, 20)
        b = stack.enter_context(replica(sb, "b", doc, port_b))
        a.stop()
        wait_for(lambda: "caller-0" in connected(b), 20)
        r = b.set_weights("llm", {"v1": 0, "v2": 100}, timeout=15)
        assert r.ok and r.acked == ["caller-0"], r
        before = t.replies["v2"]
        wait_for(lambda: t.replies["v2"] > before + 20, 20)
        t.__exit__(None, None, None)
        assert set(t.codes) == {"OK"}, t.codes


def test_one_replica_on_the_file_store_alone(tmp_path, upstreams):
    v1, v2 = upstreams
    with (
        FileStore(tmp_path / "state.json") as s,
        replica(s, "only", source(v1.port, v2.port)) as cp,
        caller("caller-0", cp) as target,
    ):
        wait_for(lambda: routed(target) == {"v1": 20}, 20)
        r = cp.set_weights("llm", {"v1": 0, "v2": 100}, timeout=15)
        assert r.ok and r.acked == ["caller-0"], r
        assert routed(target) == {"v2": 20}

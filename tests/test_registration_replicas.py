"""Registrations shared by control-plane replicas on a real etcd: `meshlm xds-server --store`
processes, real caller Envoys (one on each replica), real gRPC upstreams registered by the
sidecar's client (sidecar/registration.py). Every replica serves the same registered hosts and
their health; when
the leader replica is SIGKILLed the host it held moves to the survivor without leaving any
caller's EDS; a host that vanishes leaves every replica once its lease (the grace period) ends;
the limits hold across replicas."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.etcd_support import EtcdCluster, Partition
from tests.registration_processes import (
    ControlPlaneProcess,
    EdsSampler,
    PacedCalls,
    caller_envoy,
    control_planes,
    eds_hosts,
    registration,
    write_mesh,
)
from tests.registration_support import RawStream, register_body
from tests.test_xds_support import eventually, upstreams
from xds_server.store import EtcdStore, encode
from xds_server.store.url import store_root

GRACE = 3.0
TTL = 2


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdCluster]:
    with EtcdCluster(1) as cluster:
        yield cluster


def _replicas(
    etcd: EtcdCluster, tmp: Path, mesh: Path, root: str | None = None
) -> list[ControlPlaneProcess]:
    url = f"etcd://{etcd.endpoints[0]}/{root or f't-{uuid.uuid4().hex}'}"
    return [
        ControlPlaneProcess(
            tmp, name, mesh, "--store", url, "--replica-id", name, "--leader-ttl", str(TTL),
            "--state-dir", str(tmp / f"state-{name}"),
        )
        for name in ("r1", "r2")
    ]  # fmt: skip


def _leader(cps: list[ControlPlaneProcess]) -> tuple[ControlPlaneProcess, ControlPlaneProcess]:
    def elected():
        st = [cp.status() for cp in cps]
        return st if all(st) and all(s.get("leader") for s in st) else None

    st = eventually(elected, 60, "a leader elected")
    return (cps[0], cps[1]) if st[0]["leading"] else (cps[1], cps[0])


def _same_everywhere(cps: list[ControlPlaneProcess], address: str) -> dict | None:
    """The host's row where every replica has it with the same fields (else None)."""
    rows = [cp.registered().get(address) for cp in cps]
    if not all(rows):
        return None
    fields = ("service", "version", "node", "health", "zone", "weight", "since")
    views = {tuple(r[f] for f in fields) for r in rows}
    return rows[0] if len(views) == 1 else None


def test_every_replica_serves_the_host_and_it_survives_the_leaders_death(etcd, tmp_path) -> None:
    cps = _replicas(etcd, tmp_path, write_mesh(tmp_path / "mesh.yaml", f"{GRACE:g}s"))
    with upstreams("h1", health=True) as ups, control_planes(*cps):
        for cp in cps:
            cp.start()
        leader, follower = _leader(cps)
        address = ups["h1"].address
        e1, port = caller_envoy("caller-1", [leader.xds, follower.xds])
        e2, _ = caller_envoy("caller-2", [follower.xds, leader.xds])
        client = registration("h1-node", address, [leader.xds, follower.xds], (0.2, 1.0))
        try:
            with e1, e2:
                client.start()
                row = eventually(lambda: _same_everywhere(cps, address), 60, "on every replica")
                assert row["health"] == "SERVING" and row["stream"] == "open", row
                for envoy in (e1, e2):
                    eventually(lambda e=envoy: address in eds_hosts(e), 30, "in each caller's EDS")
                with PacedCalls(port) as calls, EdsSampler([e1, e2], address) as sampler:
                    eventually(lambda: calls.served["h1"] >= 5, what="calls reach the host")
                    eventually(lambda: client.registrations == 1, 30, "answered")
                    leader.kill()  # its stream, its lease and its leadership die with it
                    eventually(lambda: (follower.status() or {}).get("leading"), TTL + 10,
                               "the follower leads")  # fmt: skip
                    eventually(lambda: client.registrations == 2, 30, "registered on the survivor")
                    eventually(lambda: follower.registered()[address]["stream"] == "open", 10)
                    # The dead replica's lease ends a grace period after its last keep-alive:
                    # the host, taken over, must outlive it.
                    time.sleep(GRACE + 2)
                    assert follower.registered().get(address, {}).get("stream") == "open"
                    after = calls.served["h1"]
                    eventually(lambda: calls.served["h1"] >= after + 5, what="calls go on")
                assert sampler.samples > 20 and sampler.gaps == [], sampler.gaps[:3]
                assert calls.failures == [], calls.failures[:3]
        finally:
            client.stop()
    for cp in cps:
        assert "Traceback" not in cp.output(), cp.output()[-3000:]


def test_a_vanished_host_leaves_every_replica_after_the_grace_period(etcd, tmp_path) -> None:
    cps = _replicas(etcd, tmp_path, write_mesh(tmp_path / "mesh.yaml", f"{GRACE:g}s"))
    with upstreams("h1", health=True) as ups, control_planes(*cps):
        for cp in cps:
            cp.start()
        r1, r2 = cps
        address = ups["h1"].address
        e1, _ = caller_envoy("caller-1", [r1.xds])
        e2, _ = caller_envoy("caller-2", [r2.xds])
        serving = [True]
        client = registration("h1-node", address, [r1.xds], (0.2, 1.0), lambda: serving[0])
        try:
            with e1, e2:
                eventually(lambda: all(cp.status() for cp in cps), 60, "replicas up")
                client.start()
                eventually(lambda: _same_everywhere(cps, address), 60, "on every replica")
                for envoy in (e1, e2):
                    eventually(lambda e=envoy: address in eds_hosts(e), 30, "in each caller's EDS")
                # Its health, told to r1, is every replica's.
                serving[0] = False
                for envoy in (e1, e2):
                    eventually(lambda e=envoy: "failed_eds_health" in eds_hosts(e).get(address, ""),
                               20, "unhealthy in each caller's EDS")  # fmt: skip
                assert _same_everywhere(cps, address)["health"] == "NOT_SERVING"
                serving[0] = True
                for envoy in (e1, e2):
                    eventually(lambda e=envoy: eds_hosts(e).get(address) == "healthy", 20)
                client.stop()  # the stream ends without a deregistration: the host vanished
                lost = time.monotonic()
                # Each replica is seen marking it lost at some poll: the host leaves after GRACE,
                # so one poll catching all three at once can miss the window under load.
                lost_at: set[int] = set()

                def each_marked_lost() -> bool:
                    lost_at.update(
                        i for i, cp in enumerate(cps)
                        if cp.registered().get(address, {}).get("stream") == "lost"
                    )  # fmt: skip
                    return len(lost_at) == len(cps)

                eventually(each_marked_lost, 30, "marked lost on every replica")
                assert all(address in eds_hosts(e) for e in (e1, e2)), "kept for the grace period"
                eventually(lambda: not any(address in cp.registered() for cp in cps), GRACE + 20,
                           "gone from every replica")  # fmt: skip
                assert time.monotonic() - lost >= GRACE - 1, "not before its grace period"
                for envoy in (e1, e2):
                    eventually(lambda e=envoy: address not in eds_hosts(e), 10, "out of EDS")
        finally:
            client.stop()
    for cp in cps:
        assert "Traceback" not in cp.output(), cp.output()[-3000:]


def test_the_limits_hold_across_replicas(etcd, tmp_path) -> None:
    mesh = write_mesh(tmp_path / "mesh.yaml", f"{GRACE:g}s")
    text = mesh.read_text().replace("enabled: true", "enabled: true\n    max_total: 2")
    mesh.write_text(text)
    cps = _replicas(etcd, tmp_path, mesh)
    with control_planes(*cps):
        for cp in cps:
            cp.start()
        eventually(lambda: all(cp.status() for cp in cps), 60, "replicas up")
        channels = [grpc.insecure_channel(f"127.0.0.1:{cp.grpc_port}") for cp in cps]
        streams = []
        try:
            for i, port in enumerate((9001, 9002)):
                s = RawStream(channel=channels[i])
                streams.append(s.send(register_body(f"127.0.0.1:{port}", node=f"n{i}")))
                assert "registered" in s.recv(), s.status(1)
            third = RawStream(channel=channels[1]).send(register_body("127.0.0.1:9003", "n3"))
            code, details = third.status()
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
            assert "max_total" in details, details
            # The same address registered on the other replica by another node is refused.
            dup = RawStream(channel=channels[0]).send(register_body("127.0.0.1:9002", "n9"))
            code, details = dup.status()
            assert code == grpc.StatusCode.ALREADY_EXISTS and "n1" in details, (code, details)
        finally:
            for s in streams:
                s.end()
            for ch in channels:
                ch.close()


def test_a_bad_registration_record_in_the_store_is_left_out_and_named(etcd, tmp_path) -> None:
    """Whoever can write the store can write any record: each is checked like a registration
    message; a bad one is left out (and named), the good ones still served, readiness kept."""
    root = f"t-{uuid.uuid4().hex}"
    cps = _replicas(etcd, tmp_path, write_mesh(tmp_path / "mesh.yaml", "60s"), root)
    store = EtcdStore(etcd.endpoints, root=store_root(root))
    good = {"node_id": "n1", "address": "127.0.0.1:9001", "service": "llm", "version": "v1",
            "health": "SERVING", "since": 1.0, "lost_at": None}  # fmt: skip
    bad = {
        "registrations/127.0.0.1:9002": b"{not json",
        "registrations/127.0.0.1:9003": encode({**good, "address": "127.0.0.1:9004"}),
        "registrations/127.0.0.1:9005": encode({**good, "address": "127.0.0.1:9005", "weight": 0}),
    }
    with control_planes(*cps):
        for cp in cps:
            cp.start()
        eventually(lambda: all(cp.status() for cp in cps), 60, "replicas up")
        for key, value in bad.items():
            store.put(key, value, revision=0)
        store.put("registrations/127.0.0.1:9001", encode(good), revision=0)
        for cp in cps:
            eventually(lambda c=cp: set(c.registered()) == {"127.0.0.1:9001"}, 20, "good one")
            rejected = cp.get("/debug/syncz")["registrations_rejected"]
            assert set(rejected) == set(bad), rejected
            assert "not its key's" in rejected["registrations/127.0.0.1:9003"], rejected
            assert "register.weight" in rejected["registrations/127.0.0.1:9005"], rejected
            assert cp.get("/readyz")["status"] == "ready"
    store.close()


def test_the_hosts_of_a_dead_replica_leave_after_the_grace_period_unless_they_move(
    etcd, tmp_path
) -> None:
    """The dead replica's lease ends a grace period after its last keep-alive: a host that
    registered again on another replica stays, one that could not leaves then."""
    cps = _replicas(etcd, tmp_path, write_mesh(tmp_path / "mesh.yaml", f"{GRACE:g}s"))
    r1, r2 = cps
    with upstreams("stays", "leaves", health=True) as ups, control_planes(*cps):
        for cp in cps:
            cp.start()
        stays, leaves = ups["stays"].address, ups["leaves"].address
        envoy, _ = caller_envoy("caller-1", [r1.xds])
        clients = [
            registration("stays-node", stays, [r2.xds, r1.xds], (0.2, 1.0)),
            registration("leaves-node", leaves, [r2.xds], (0.2, 1.0)),  # knows r2 alone
        ]
        try:
            with envoy:
                eventually(lambda: all(cp.status() for cp in cps), 60, "replicas up")
                for c in clients:
                    c.start()
                eventually(lambda: _same_everywhere(cps, stays) and _same_everywhere(cps, leaves),
                           60, "both on every replica")  # fmt: skip
                eventually(lambda: len(eds_hosts(envoy)) == 2, 30, "both in the caller's EDS")
                eventually(lambda: all(c.registrations == 1 for c in clients), 30, "answered")
                r2.kill()
                killed = time.monotonic()
                eventually(lambda: leaves not in r1.registered(), GRACE + 20, "leaves expired")
                assert time.monotonic() - killed >= GRACE - 1, "not before the grace period"
                eventually(lambda: leaves not in eds_hosts(envoy), 10, "out of the caller's EDS")
                assert r1.registered()[stays]["stream"] == "open", r1.registered()
                # (its answer waits for every replica's sidecars: the dead one's ACK summary
                # holds it back until that replica's lease ends)
                eventually(lambda: clients[0].registrations == 2, 30, str(clients[0].said))
                assert eds_hosts(envoy).get(stays) == "healthy"
        finally:
            for c in clients:
                c.stop()


def test_a_host_that_registers_on_another_replica_takes_its_key_over(etcd, tmp_path) -> None:
    """Its stream moved while the first replica still holds the old one (a network blip): the
    newer stream owns the host everywhere; the older one is told so at its next message and
    its end takes nothing away."""
    cps = _replicas(etcd, tmp_path, write_mesh(tmp_path / "mesh.yaml", f"{GRACE:g}s"))
    with control_planes(*cps):
        for cp in cps:
            cp.start()
        eventually(lambda: all(cp.status() for cp in cps), 60, "replicas up")
        channels = [grpc.insecure_channel(f"127.0.0.1:{cp.grpc_port}") for cp in cps]
        try:
            old = RawStream(channel=channels[0]).send(register_body("127.0.0.1:9001", "n1"))
            assert "registered" in old.recv(), old.status(1)
            new = RawStream(channel=channels[1]).send(register_body("127.0.0.1:9001", "n1"))
            assert "registered" in new.recv(), new.status(1)
            old.send({"health": "NOT_SERVING"})
            code, details = old.status()
            assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, details)
            assert "registered again on a newer stream" in details, details
            time.sleep(GRACE + 1)  # past the old stream's grace period
            for cp in cps:
                row = cp.registered().get("127.0.0.1:9001")
                assert row and row["stream"] == "open" and row["health"] == "SERVING", row
            new.end()
        finally:
            for ch in channels:
                ch.close()


def test_a_replica_cut_off_longer_than_the_grace_period_writes_its_hosts_again(
    etcd, tmp_path
) -> None:
    """r1 cannot renew its registration lease while cut off from etcd: the store ends it, and
    r2 drops the host (nobody vouches for it). Its stream stayed open on r1, so once r1 reaches
    the store again it writes the host again and every replica has it back."""
    root = f"t-{uuid.uuid4().hex}"
    mesh = write_mesh(tmp_path / "mesh.yaml", f"{GRACE:g}s")
    with Partition(etcd.endpoints[0]) as cut, upstreams("h1", health=True) as ups:
        r1 = ControlPlaneProcess(
            tmp_path, "r1", mesh, "--store", f"etcd://{cut.endpoint}/{root}", "--replica-id",
            "r1", "--leader-ttl", str(TTL), "--state-dir", str(tmp_path / "state-r1"),
        )  # fmt: skip
        r2 = _replicas(etcd, tmp_path, mesh, root)[1]
        cps = [r1, r2]
        address = ups["h1"].address
        client = registration("h1-node", address, [r1.xds], (0.2, 1.0))
        with control_planes(*cps):
            for cp in cps:
                cp.start()
            try:
                eventually(lambda: all(cp.status() for cp in cps), 60, "replicas up")
                client.start()
                eventually(lambda: _same_everywhere(cps, address), 60, "on every replica")
                eventually(lambda: client.registrations == 1, 30, "answered")
                cut.cut()
                eventually(lambda: address not in r2.registered(), GRACE + 20, "r1's lease ended")
                cut.heal()
                row = eventually(lambda: _same_everywhere(cps, address), 30, "written again")
                assert row["stream"] == "open", row
                assert client.registrations == 1, client.said  # the same stream all along
                assert "registration lease ended" in r1.output(), r1.output()[-2000:]
            finally:
                client.stop()

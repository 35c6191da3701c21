"""Faults on control-plane replicas sharing a store (issue 34): `meshlm fault add` through one
replica is written to the store (`faults`) and answered once the caller sidecars of both
replicas ACKed it; a fault set with a duration is removed when it ends (every replica runs
the expiry: the first to remove it wins, the others find nothing to do); a new mesh file
applied through either keeps it. Real etcd, real Envoys."""

from __future__ import annotations

import json

from tests.etcd_support import wait_for
from tests.test_faults_envoy import TOKEN, _meshlm
from tests.test_replicas_sync import (  # noqa: F401 (the module's fixtures)
    etcd,
    routed,
    source,
    two_replicas,
    upstreams,
)
from xds_server.admin.api import AdminServer
from xds_server.mesh import parse_mesh
from xds_server.store import keys


def test_a_fault_through_one_replica_reaches_the_sidecars_of_both(etcd, upstreams):  # noqa: F811
    v1, v2 = upstreams
    with two_replicas(etcd, upstreams) as pair:
        a, b, via_a, via_b = pair.a, pair.b, pair.via_a, pair.via_b
        admin_a = AdminServer(a, token=TOKEN).start()
        admin_b = AdminServer(b, token=TOKEN).start()
        try:
            wait_for(lambda: routed(via_a) == {"v1": 20} and routed(via_b) == {"v1": 20}, 20)
            r = _meshlm("fault", "add", "down", "--service", "llm", "--abort-grpc", "14",
                        "--admin", admin_a.url)  # fmt: skip
            assert r.returncode == 0, r.stderr
            assert "caller-a" in r.stdout and "caller-b" in r.stdout, r.stdout
            # Returned once both sidecars held it: no wait before reading either.
            assert routed(via_b, 5) == {"failed": {"UNAVAILABLE": 5}}
            assert routed(via_a, 5) == {"failed": {"UNAVAILABLE": 5}}
            assert (
                "down: llm: abort gRPC 14"
                in _meshlm("fault", "list", "--admin", admin_b.url).stdout
            )
            stored = json.loads(pair.store.get(keys.FAULTS).value)
            assert [f["name"] for f in stored["faults"]] == ["down"]

            # A new mesh file through the other replica keeps the run-time fault.
            new = source(v1.port, v2.port, (50, 50))
            assert b.apply_mesh(parse_mesh(new), source=new, timeout=10).ok
            assert set(a.mesh.faults) == {"down"} == set(b.mesh.faults)

            # Removed through b; a timed one set through b ends by itself on both.
            r = _meshlm("fault", "remove", "down", "--admin", admin_b.url)
            assert r.returncode == 0, r.stderr
            wait_for(lambda: routed(via_a, 5) == routed(via_b, 5) == {"v1": 5}, 20)
            r = _meshlm("fault", "add", "brief", "--service", "llm", "--abort-http", "503",
                        "--duration", "2s", "--admin", admin_b.url)  # fmt: skip
            assert r.returncode == 0, r.stderr
            assert routed(via_a, 3) == {"failed": {"UNAVAILABLE": 3}}
            wait_for(lambda: not a.mesh.faults and not b.mesh.faults, 20)
            wait_for(lambda: routed(via_a, 5) == routed(via_b, 5) == {"v1": 5}, 20)
        finally:
            admin_a.stop()
            admin_b.stop()

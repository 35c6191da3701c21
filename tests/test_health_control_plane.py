"""Health of the control plane (issue 16, item 3): GET /healthz and /readyz on the admin port
(no token), grpc.health.v1 on the ADS port, and `python -m meshlm.probe`, the Kubernetes exec
probe over them (deploy/kubernetes/). On real `meshlm xds-server` processes, one of them a
replica on a real etcd that stays ready on its last good config when etcd goes away."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
import uuid

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh_common.ports import free_port
from tests.etcd_support import EtcdCluster, wait_for
from tests.test_replicas_cli import MESH, Replica, env  # noqa: F401 (env: a fixture)
from xds_server.admin.api import AdminServer
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.xds.health import ADS_SERVICE

SERVING = health_pb2.HealthCheckResponse.SERVING


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:  # no Authorization header
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def probe(url: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshlm.probe", url], capture_output=True, text=True, timeout=30
    )


def grpc_port(r: Replica) -> int:
    return int(r.proc.args[r.proc.args.index("--grpc-port") + 1])


def check(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def ready(r: Replica) -> dict | None:
    try:
        code, doc = get(r.admin + "/readyz")
    except OSError:
        return None
    return doc if code == 200 else None


@pytest.fixture
def started():
    procs: list[Replica] = []
    yield procs
    for r in procs:
        if r.proc.poll() is None:
            r.proc.terminate()
            try:
                r.proc.wait(15)
            except subprocess.TimeoutExpired:
                r.kill()


def test_a_control_plane_is_alive_and_ready_on_both_ports(tmp_path, env, started):  # noqa: F811
    (tmp_path / "mesh.yaml").write_text(yaml.safe_dump(MESH))
    started.append(r := Replica(tmp_path, env, "one"))
    doc = wait_for(lambda: ready(r), 30)
    assert doc["status"] == "ready" and doc["ads_port"] == grpc_port(r), doc
    assert get(r.admin + "/healthz") == (200, {"status": "alive"})
    for service in ("", ADS_SERVICE):
        assert check(grpc_port(r), service) == SERVING
    with pytest.raises(grpc.RpcError) as e:
        check(grpc_port(r), "no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port(r)}") as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        assert next(watch).status == SERVING
        watch.cancel()

    ok = probe(r.admin + "/readyz")
    assert ok.returncode == 0 and '"ready"' in ok.stdout, ok
    gone = probe(f"http://127.0.0.1:{free_port()}/readyz")
    assert gone.returncode == 1 and "refused" in gone.stderr.lower(), gone
    ok = probe(f"grpc://127.0.0.1:{grpc_port(r)}")
    assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok
    gone = probe(f"grpc://127.0.0.1:{free_port()}")
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr, gone
    assert "Traceback" not in r.output()


def test_readyz_is_503_until_the_ads_port_serves_and_after_it_stops():
    cp = build_server(parse_mesh(MESH))
    admin = AdminServer(cp, token="t" * 32).start()
    try:
        code, doc = get(admin.url + "/readyz")
        assert code == 503 and doc["status"] == "not ready", doc
        assert "not serving" in doc["reason"]
        assert get(admin.url + "/healthz")[0] == 200  # alive all the same
        assert probe(admin.url + "/readyz").returncode == 1
        cp.start()
        code, doc = get(admin.url + "/readyz")
        assert code == 200 and doc["ads_port"] == cp.grpc_port, doc
        cp.stop()
        assert get(admin.url + "/readyz")[0] == 503
    finally:
        cp.stop()
        admin.stop()


def test_a_replica_stays_ready_on_its_last_good_config_when_etcd_is_gone(
    tmp_path,
    env,  # noqa: F811
    started,
):
    with EtcdCluster(1) as etcd:
        url = f"etcd://{etcd.endpoints[0]}/t-{uuid.uuid4().hex}"
        started.append(r := Replica(tmp_path, env, "r1", "--store", url, "--leader-ttl", "2"))
        doc = wait_for(lambda: ready(r), 30)
        assert doc["replica"] == "r1" and doc["store"] == "answering", doc
        assert doc["store_revision"] > 0
        etcd.kill(0)
        doc = wait_for(lambda: (d := ready(r)) and d["store"] != "answering" and d, 20)
        assert doc["store"].startswith("not answering"), doc
        assert "serving the last good config" in doc["store"]
        assert check(grpc_port(r), "") == SERVING
        assert probe(r.admin + "/readyz").returncode == 0


def test_with_identity_the_probe_reads_readyz_over_https_and_ads_needs_a_certificate(
    tmp_path,
    env,  # noqa: F811
    started,
):
    """Why deploy/kubernetes/ probes the admin port: with identity ADS is mTLS, and a probe,
    holding no client certificate, cannot even ask it for its health."""
    mesh = dict(MESH, identity={"trust_domain": "example.org"})
    mesh["control_plane"] = {"ca_port": 0, "ca_mtls_port": 0}
    (tmp_path / "mesh.yaml").write_text(yaml.safe_dump(mesh))
    started.append(r := Replica(tmp_path, env, "id"))
    https = r.admin.replace("http://", "https://") + "/readyz"
    wait_for(lambda: probe(https).returncode == 0 or r.proc.poll() is not None, 60)
    ok = probe(https)
    assert ok.returncode == 0 and '"ready"' in ok.stdout, (ok, r.output())
    plain = probe(r.admin + "/readyz")  # the port speaks HTTPS only
    assert plain.returncode == 1, plain
    no_cert = probe(f"grpc://127.0.0.1:{grpc_port(r)}")
    assert no_cert.returncode == 1 and "UNAVAILABLE" in no_cert.stderr, no_cert

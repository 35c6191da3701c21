"""`meshlm xds-server --store etcd://...` as processes (issue 15): two replicas on one real etcd
elect one leader and both say which (GET /); a follower takes weight changes (written through
the store, seen by the leader) and refuses rollout commands naming the leader; when the leader
is killed the follower leads within the lease TTL plus a few seconds. Bad flags are refused."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from mesh_common.ports import free_port
from meshlm.state_dir import default_state_dir
from tests.etcd_support import EtcdCluster, wait_for
from xds_server.identity.ca import MeshCA, key_pem, pem

TOKEN = "replica-test-token-0123456789"
TTL = 2
MESH = {
    "services": {
        "llm": {
            "versions": {
                "v1": {"endpoints": ["127.0.0.1:9"]},
                "v2": {"endpoints": ["127.0.0.1:10"]},
            },
            "route": {"weights": {"v1": 100, "v2": 0}},
        }
    },
    "rollouts": {"llm": {"stable": "v1", "canary": "v2", "steps": [50, 100], "interval": "1s"}},
}


@pytest.fixture(scope="module")
def etcd():
    with EtcdCluster(1) as cluster:
        yield cluster


@pytest.fixture
def env(tmp_path: Path) -> dict:
    run = tmp_path / "xdg"
    run.mkdir(mode=0o700)
    return {**os.environ, "XDG_RUNTIME_DIR": str(run), "MESHLM_ADMIN_TOKEN": TOKEN}


class Replica:
    def __init__(self, tmp: Path, env: dict, name: str, *args: str) -> None:
        mesh = tmp / "mesh.yaml"
        if not mesh.exists():
            mesh.write_text(yaml.safe_dump(MESH))
        self.port = port = free_port()
        self.admin = f"http://127.0.0.1:{port}"
        self.run_dir = Path(env["XDG_RUNTIME_DIR"]) / "meshlm"
        self.log = tmp / f"xds-{name}.log"
        argv = [sys.executable, "-m", "meshlm.cli", "xds-server", "--mesh", str(mesh),
                "--grpc-port", str(free_port()), "--admin-port", str(port),
                "--replica-id", name, *args]  # fmt: skip
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)

    def call(self, method: str, path: str, doc: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(
            self.admin + path,
            method=method,
            data=json.dumps(doc).encode() if doc is not None else None,
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        ctx = None
        if f"admin on https://127.0.0.1:{self.port}" in self.output():  # a mesh with identity
            req.full_url = req.full_url.replace("http://", "https://", 1)
            ctx = ssl.create_default_context(cafile=self.run_dir / f"admin-{self.port}-ca.pem")
        try:
            with urllib.request.urlopen(req, timeout=20, context=ctx) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def status(self) -> dict | None:
        try:
            return self.call("GET", "/")[1]
        except OSError:
            return None

    def output(self) -> str:
        return self.log.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def meshlm_status(r: Replica, env: dict) -> str:
    p = subprocess.run([sys.executable, "-m", "meshlm.cli", "status", "--admin", r.admin],
                       env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.fixture
def replicas() -> Iterator[list[Replica]]:
    started: list[Replica] = []
    yield started
    for r in started:
        if r.proc.poll() is None:
            r.proc.terminate()
            try:
                r.proc.wait(15)
            except subprocess.TimeoutExpired:
                r.kill()


def test_two_replicas_elect_one_leader_and_a_follower_writes_through_the_store(
    etcd, tmp_path, env, replicas
):
    url = f"etcd://{','.join(etcd.endpoints)}/t-{uuid.uuid4().hex}"
    for name in ("r1", "r2"):
        replicas.append(Replica(tmp_path, env, name, "--store", url, "--leader-ttl", str(TTL)))

    def leaders():
        st = [r.status() for r in replicas]
        return st if all(st) and all(s.get("leader") for s in st) else None

    st = wait_for(leaders, 30)
    assert {s["leader"]["id"] for s in st} == {s["replica"] for s in st if s["leading"]}
    leader, follower = replicas if st[0]["leading"] else replicas[::-1]
    wait_for(lambda: leader.status()["leader_work"] == "leading", 10)
    assert follower.status()["leader_work"] == "following"
    # meshlm status names the replica it asked, the leader, and the leader's work in its words.
    lead_id = st[0]["leader"]["id"]
    for r, role in ((follower, "follower"), (leader, "leader")):
        out = meshlm_status(r, env)
        assert f"replica {r.status()['replica']} ({role}, store revision " in out, out
        assert f"leader {lead_id} (term " in out and f"{leader.admin}), its work: leading" in out

    code, doc = follower.call("POST", "/v1/services/llm/weights", {"v1": 60, "v2": 40})
    assert code == 200 and doc["ok"] and doc["revision"] > 0, doc
    # The leader staged it (watching the store); no sidecar is connected to show it.
    wait_for(lambda: leader.status()["store"]["revision"] >= doc["revision"], 10)

    code, doc = follower.call("POST", "/rollouts/llm", {})
    assert code == 503, doc
    assert "does not lead" in doc["error"] and leader.admin in doc["error"], doc
    code, doc = leader.call("POST", "/rollouts/llm/pause", {})
    assert code == 404 and "no rollout" in doc["error"], doc  # the leader's own controller
    code, doc = follower.call("GET", "/rollouts")  # read from the store
    assert code == 200 and doc == {}, doc

    leader.kill()
    now = wait_for(lambda: (s := follower.status()) and s["leading"] and s, TTL + 5)
    assert now["leader"]["id"] == now["replica"]
    wait_for(lambda: follower.status()["leader_work"] == "leading", 10)
    code, doc = follower.call("POST", "/rollouts/llm/pause", {})
    assert code == 404 and "no rollout" in doc["error"], doc
    assert "Traceback" not in follower.output()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--leader-ttl", "0"], "--leader-ttl: must be seconds > 0"),
        (["--store", "zk://h:1"], "unknown kind"),
    ],
)
def test_bad_replica_flags_are_refused(tmp_path, env, args, message):
    r = Replica(tmp_path, env, "bad", *args)
    try:
        assert r.proc.wait(60) == 2
    finally:
        r.kill()
    assert message in r.output() and "Traceback" not in r.output(), r.output()


def test_identity_on_etcd_needs_a_root_shared_by_every_replica(etcd, tmp_path, env, replicas):
    mesh = dict(MESH, identity={"trust_domain": "example.org"})
    (tmp_path / "mesh.yaml").write_text(yaml.safe_dump(mesh))
    url = f"etcd://{etcd.endpoints[0]}/t-{uuid.uuid4().hex}"
    r = Replica(tmp_path, env, "id", "--store", url)
    try:
        assert r.proc.wait(60) == 2
    finally:
        r.kill()
    assert "needs a root shared by every replica: identity.root" in r.output(), r.output()
    # With the same user root given to each, two replicas serve (each an intermediate of it).
    root_ca = MeshCA(trust_domain="example.org")
    (tmp_path / "root.pem").write_text(pem(root_ca.trust_bundle()[0]))
    (tmp_path / "root.key").write_bytes(key_pem(root_ca._roots[0].key))
    root = {"cert_file": str(tmp_path / "root.pem"), "key_file": str(tmp_path / "root.key")}
    mesh["identity"] = {"trust_domain": "example.org", "root": root}
    mesh["control_plane"] = {"ca_port": 0, "ca_mtls_port": 0}  # else ADS port + 2, + 3
    (tmp_path / "mesh.yaml").write_text(yaml.safe_dump(mesh))
    for name in ("i1", "i2"):
        replicas.append(Replica(tmp_path, env, name, "--store", url))
    for rep in replicas:
        wait_for(lambda rep=rep: "mesh CA for example.org" in rep.output(), 30)
        assert rep.proc.poll() is None, rep.output()
    # Join tokens are each replica's own (a sidecar enrolls at its first --xds replica's CA).
    code, doc = replicas[0].call("POST", "/identity/tokens", {"service_account": "default/llm"})
    assert code == 200, doc
    state = default_state_dir(tmp_path / "mesh.yaml")  # the replicas' env: this run's state home
    assert sorted(p.name for p in state.iterdir() if "identity" in p.name) == ["identity-i1"]


def test_sidecar_xds_lists_replicas_and_names_a_bad_one(env):
    r = subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "sidecar", "--xds", "127.0.0.1:1,replica-2",
         "--outbound-port", "1"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "expected HOST:PORT, got 'replica-2'" in r.stderr, r.stderr

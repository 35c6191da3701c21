"""The README's two commands for replicas on etcd (issue 15), as processes: `meshlm etcd` starts
a local etcd and prints the --store URL; `meshlm xds-server --store URL --replicas 2` starts two
replicas on ports 10 apart, one of which leads; a change made through the second is ACKed by a
real Envoy that lists both. Ctrl-C stops each command and everything it started."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.etcd_support import wait_for
from tests.rollout_upstreams import Upstream
from tests.test_replicas_sync import routed

TOKEN = "etcd-cli-test-token-0123456789"
STRIDE = 10  # meshlm.commands.xds_server.REPLICA_PORT_STRIDE


def ports_free(*ports: int) -> bool:
    try:
        socks = [socket.create_server(("127.0.0.1", p)) for p in ports]
    except OSError:
        return False
    for s in socks:
        s.close()
    return True


def free_base(*offsets: int) -> int:
    """A port P with P + each offset free a moment ago."""
    return wait_for(lambda: (p := free_port()) < 65000 and ports_free(*(p + o for o in offsets))
                    and p)  # fmt: skip


def meshlm(*args: str, log: Path, env: dict) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "meshlm.cli", *args], env=env,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip


def get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_meshlm_etcd_and_xds_server_replicas_serve_a_sidecar_and_stop_on_ctrl_c(tmp_path):
    run = tmp_path / "xdg"
    run.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(run), "MESHLM_ADMIN_TOKEN": TOKEN}
    etcd_port = free_base(0, 1)
    etcd = meshlm("etcd", "--port", str(etcd_port), log=tmp_path / "etcd.log", env=env)
    reps = None
    try:
        line = wait_for(lambda: [x for x in (tmp_path / "etcd.log").read_text().splitlines()
                                 if x.startswith("store: ")], 30)  # fmt: skip
        url = line[0].removeprefix("store: ")
        assert url.startswith(f"etcds://127.0.0.1:{etcd_port}/meshlm?creds="), url
        data_dir = Path((tmp_path / "etcd.log").read_text().split("(data in ")[1].split(",")[0])
        assert data_dir.is_dir()

        with Upstream("v1") as v1, Upstream("v2") as v2:
            mesh = tmp_path / "mesh.yaml"
            mesh.write_text(yaml.safe_dump({
                "control_plane": {"debounce": "20ms"},
                "services": {"llm": {
                    "versions": {"v1": {"endpoints": [f"127.0.0.1:{v1.port}"]},
                                 "v2": {"endpoints": [f"127.0.0.1:{v2.port}"]}},
                    "route": {"weights": {"v1": 100, "v2": 0}}}},
            }))  # fmt: skip
            grpc, admin = free_base(0, STRIDE), free_base(0, STRIDE)
            log = tmp_path / "replicas.log"
            reps = meshlm("xds-server", "--mesh", str(mesh), "--store", url, "--replicas", "2",
                          "--grpc-port", str(grpc), "--admin-port", str(admin),
                          "--leader-ttl", "3", log=log, env=env)  # fmt: skip
            admins = [f"http://127.0.0.1:{admin + STRIDE * i}" for i in range(2)]
            docs = wait_for(lambda: (d := [get(a + "/") for a in admins]) and all(
                x and x.get("leader") for x in d) and d, 60)  # fmt: skip
            assert [d["replica"] for d in docs] == ["r1", "r2"], docs
            assert sum(d["leading"] for d in docs) == 1, docs
            out = log.read_text()
            assert "[r1] " in out and "[r2] " in out, out
            xds = f"127.0.0.1:{grpc},127.0.0.1:{grpc + STRIDE}"
            assert f"meshlm sidecar --xds {xds}" in out, out

            listen = free_port()
            boot = ads_bootstrap("caller", xds_address=[("127.0.0.1", grpc),
                                 ("127.0.0.1", grpc + STRIDE)], outbound_port=listen)  # fmt: skip
            with EnvoyProcess(boot):
                target = f"127.0.0.1:{listen}"
                wait_for(lambda: routed(target) == {"v1": 20}, 30)
                req = urllib.request.Request(
                    admins[1] + "/v1/services/llm/weights",
                    data=json.dumps({"v1": 0, "v2": 100}).encode(),
                    headers={"Authorization": f"Bearer {TOKEN}"},
                    method="POST",
                )
                with urllib.request.urlopen(req, timeout=30) as r:
                    doc = json.loads(r.read())
                assert r.status == 200 and doc["ok"] and doc["acked"] == ["caller"], doc
                assert routed(target) == {"v2": 20}

            pids = [int(x.split("(pid ")[1].split(")")[0]) for x in out.splitlines()
                    if x.startswith("replicas: r")]  # fmt: skip
            assert len(pids) == 2, out
            reps.send_signal(signal.SIGINT)
            assert reps.wait(60) == 0, log.read_text()[-3000:]
            assert all(gone(p) for p in pids), log.read_text()[-3000:]
            assert "Traceback" not in log.read_text()

        etcd.send_signal(signal.SIGINT)
        assert etcd.wait(30) == 0, (tmp_path / "etcd.log").read_text()
        assert "etcd: stopped" in (tmp_path / "etcd.log").read_text()
        assert not data_dir.exists()  # a throwaway data dir without --data-dir
    finally:
        for p in (reps, etcd):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_replicas_need_an_etcd_store_and_free_ca_ports():
    r = subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "xds-server", "--mesh", "examples/mesh.yaml",
         "--replicas", "3"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "--replicas needs --store etcd://" in r.stderr, r.stderr
    # A mesh whose CA ports are fixed: every replica would take them.
    r = subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "xds-server", "--mesh", "examples/mesh.yaml",
         "--store", "etcd://127.0.0.1:1", "--replicas", "3"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "fixes control_plane.ca_port/ca_mtls_port" in r.stderr, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "xds-server", "--mesh", "examples/mesh.yaml",
         "--store", "etcd://127.0.0.1:1", "--replicas", "2", "--isolation-store", "q.json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "name one file for every replica" in r.stderr, r.stderr


def test_meshlm_etcd_names_a_port_in_use(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "meshlm.cli", "etcd", "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert r.returncode == 1 and "address already in use" in r.stderr, r.stderr

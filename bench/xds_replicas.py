"""(c) of `python -m bench xds`: control-plane replicas on etcd vs one control plane on the file
store (issue 15), in one run, rounds interleaved (file, etcd, file, etcd...):

- convergence: a weight change -> ACKed by 3 real Envoys (all on the one replica; one per
  replica on etcd, the change made through each replica in turn);
- push: one change to M simulated sidecars (M/3 per replica on etcd);
- leader failover: two `meshlm xds-server --store etcd://` processes, the leader SIGKILLed ->
  the other leads and its leader work runs (GET /), with a short lease.

The etcd is a local 3-member cluster (xds_server.store.local_etcd) on the same cores; its CPU
per change is read from /proc (utime + stime of every member)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import yaml

from bench.bench_xds import MESH, _sim_sidecars, _wait_connected

ENVOYS = 3
REPLICAS = 3
FAILOVER_TTL = 5.0
TOKEN = "bench-replicas-token-0123456789"


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _proc_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) of the processes `pids` (/proc/PID/stat fields 14, 15)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def _etcd(tmp: Path):
    from mesh_common.ports import free_port
    from xds_server.store.local_etcd import LocalEtcd

    # Plain HTTP, as the recorded figures were measured (TLS + auth is `meshlm etcd`'s default).
    cluster = LocalEtcd(3, [free_port() for _ in range(3)], [free_port() for _ in range(3)],
                        tmp / "etcd", secure=False)  # fmt: skip
    try:
        cluster.start().wait_healthy()
        yield cluster
    finally:
        cluster.stop(signal.SIGTERM)


@contextlib.contextmanager
def _control_planes(kind: str, tmp: Path, cluster):
    """One replica on a file store ("file"), or REPLICAS on the etcd `cluster` ("etcd")."""
    from xds_server.compose import build_server
    from xds_server.mesh import parse_mesh
    from xds_server.replica.replication import Replication
    from xds_server.store import EtcdStore, FileStore

    root = f"/bench-{uuid.uuid4().hex[:8]}/"
    cps, stores = [], []
    try:
        for i in range(1 if kind == "file" else REPLICAS):
            if kind == "file":
                store = FileStore(tmp / "state" / "store.json")
            else:
                store = EtcdStore(cluster.endpoints, root=root, timeout=2.0)
            stores.append(store)
            rep = Replication(store, f"{kind}{i}", MESH)
            cps.append(build_server(parse_mesh(MESH), debounce=0.0, replication=rep).start())
        yield cps
    finally:
        for cp in cps:
            cp.stop()
        for store in stores:
            store.close()


@contextlib.contextmanager
def _envoys(cps: list):
    from mesh_common.ports import free_port
    from sidecar.bootstrap import ads_bootstrap
    from sidecar.envoy_process import EnvoyProcess

    envoys = []
    try:
        for i in range(ENVOYS):
            cp = cps[i % len(cps)]
            boot = ads_bootstrap(f"bench-{i}", xds_address=("127.0.0.1", cp.grpc_port),
                                 outbound_port=free_port())  # fmt: skip
            envoys.append(EnvoyProcess(boot).start())
        for e in envoys:
            e.wait_ready(60)
        yield envoys
    finally:
        for e in envoys:
            e.stop()


def _change(
    cps: list, k: int, expect: int, etcd_pids: list[int]
) -> tuple[float, float, float, bool]:
    """A weight change through replica k % len(cps): (seconds until all ACKed, bench process CPU
    s, etcd CPU s, fully ACKed)."""
    w = 10 + (k % 80)
    c0, e0, t0 = _cpu(), _proc_cpu(etcd_pids), time.perf_counter()
    r = cps[k % len(cps)].set_weights("llm", {"v1": 100 - w, "v2": w}, timeout=300)
    dt = time.perf_counter() - t0
    return dt, _cpu() - c0, _proc_cpu(etcd_pids) - e0, bool(r.ok and len(r.acked) >= expect)


def _rounds(setups: dict, rounds: int, per_round: int, expect: int, pids: list[int]) -> dict:
    out = {kind: {"lat": [], "cpu": [], "etcd_cpu": [], "ok": 0} for kind in setups}
    k = 0
    for _ in range(rounds):
        for kind, cps in setups.items():  # interleaved: file, etcd, file, etcd...
            for _ in range(per_round):
                dt, cpu, ecpu, ok = _change(cps, k, expect, pids if kind == "etcd" else [])
                k += 1
                o = out[kind]
                o["lat"].append(dt)
                o["cpu"].append(cpu)
                o["etcd_cpu"].append(ecpu)
                o["ok"] += ok
    return out


def _failover(cluster, tmp: Path, rounds: int) -> list[float]:
    """Seconds from SIGKILL of the leading replica process to the other's leader work running."""
    from mesh_common.ports import free_port

    mesh = tmp / "failover" / "mesh.yaml"
    mesh.parent.mkdir()
    mesh.write_text(yaml.safe_dump(MESH))
    run = tmp / "failover" / "xdg"
    run.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(run), "MESHLM_ADMIN_TOKEN": TOKEN}
    url = f"etcd://{','.join(cluster.endpoints)}/failover-{uuid.uuid4().hex[:8]}"

    def replica(name: str) -> tuple[subprocess.Popen, str]:
        admin = free_port()
        argv = [sys.executable, "-m", "meshlm.cli", "xds-server", "--mesh", str(mesh),
                "--store", url, "--leader-ttl", str(FAILOVER_TTL), "--replica-id", name,
                "--grpc-port", str(free_port()), "--admin-port", str(admin)]  # fmt: skip
        p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return p, f"http://127.0.0.1:{admin}/"

    def status(admin: str) -> dict:
        with (
            contextlib.suppress(OSError, ValueError),
            urllib.request.urlopen(admin, timeout=2) as r,
        ):
            return json.loads(r.read())
        return {}

    def working(admin: str) -> bool:
        s = status(admin)
        return bool(s.get("leading")) and s.get("leader_work") == "leading"

    live = [replica(f"f{i}") for i in range(2)]
    times: list[float] = []
    try:
        for n in range(rounds):
            end = time.monotonic() + 60
            while not any(working(a) for _, a in live):
                if time.monotonic() > end:
                    raise RuntimeError("no replica process took the lead within 60 s")
                time.sleep(0.1)
            # Both know the leader: the follower is connected to the store and watching.
            while not all(status(a).get("leader") for _, a in live):
                time.sleep(0.1)
            lead = next(i for i, (_, a) in enumerate(live) if working(a))
            proc, _ = live.pop(lead)
            t0 = time.monotonic()
            proc.kill()
            (_, other) = live[0]
            while not working(other):
                if time.monotonic() - t0 > FAILOVER_TTL + 30:
                    raise RuntimeError("the surviving replica did not take over")
                time.sleep(0.02)
            times.append(time.monotonic() - t0)
            proc.wait()
            live.append(replica(f"f{n + 2}"))  # a new follower for the next round
    finally:
        for p, _ in live:
            p.terminate()
        for p, _ in live:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    return times


def run(quick: bool) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    m = 200 if quick else 2000
    try:
        with _etcd(tmp) as cluster:
            pids = [p.pid for p in cluster.procs if p is not None]
            failover = _failover(cluster, tmp, 2 if quick else 4)
            with (
                _control_planes("file", tmp, cluster) as file_cps,
                _control_planes("etcd", tmp, cluster) as etcd_cps,
            ):
                setups = {"file": file_cps, "etcd": etcd_cps}
                with _envoys(file_cps), _envoys(etcd_cps):
                    conv = _rounds(setups, 4 if quick else 10, 5, ENVOYS, pids)
                procs: list[subprocess.Popen] = []
                try:
                    for cps in setups.values():
                        new = _sim_sidecars(cps, m)
                        procs += new
                        _wait_connected(cps, m, new)
                    push = _rounds(setups, 2 if quick else 5, 1, m, pids)
                finally:
                    for p in procs:
                        p.kill()
                        p.wait()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"m": m, "conv": conv, "push": push, "failover": failover}


def section(r: dict) -> list[str]:
    from statistics import median

    def pct(xs: list[float], q: float) -> float:
        s = sorted(xs)
        return s[min(len(s) - 1, int(q * len(s)))]

    names = {"file": "1 replica, file store", "etcd": f"{REPLICAS} replicas, 3-member etcd"}
    lines = [
        "### (c) Replicas on etcd vs one control plane on the file store (issue 15)",
        "",
        "Same run, rounds interleaved (file, etcd, file, etcd, ...); every control plane in "
        "the bench process with `Replication` (a change is written to the store and returns "
        "once every sidecar of every replica ACKed it, from the replicas' ACK summaries in the "
        f"store). Convergence: {ENVOYS} real Envoys (one per replica on etcd; the change made "
        "through each replica in turn). Push: simulated sidecars as in (b), spread evenly over "
        "the replicas. The etcd members run on the same 2 cores; their CPU per change is "
        "utime + stime from /proc. Each replica writes its sidecars' ACK summary to the store "
        "at most every 0.1 s (`Replication.publish_every`), the floor of both setups' rows; "
        "(a)'s control plane without a store has no such step.",
        "",
        "| setup | test | changes | p50 ms | p99 / max ms | bench CPU ms per change | "
        "etcd CPU ms per change | fully ACKed |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for test, label in (("conv", f"{ENVOYS} Envoys"), ("push", f"{r['m']} sidecars")):
        for kind, o in r[test].items():
            n = len(o["lat"])
            tail = pct(o["lat"], 0.99) if test == "conv" else max(o["lat"])
            ecpu = f"{median(o['etcd_cpu']) * 1000:.0f}" if kind == "etcd" else "-"
            lines.append(
                f"| {names[kind]} | {label} | {n} | {median(o['lat']) * 1000:.1f} | "
                f"{tail * 1000:.1f} | {median(o['cpu']) * 1000:.0f} | {ecpu} | {o['ok']}/{n} |"
            )
    ratios = [median(r[t]["etcd"]["lat"]) / median(r[t]["file"]["lat"]) for t in ("conv", "push")]
    f = r["failover"]
    lines += [
        "",
        f"Ratio etcd / file of the medians: convergence {ratios[0]:.2f}x, push {ratios[1]:.2f}x.",
        "",
        f"Leader failover ({len(f)} rounds): two `meshlm xds-server --store etcd://... "
        f"--leader-ttl {FAILOVER_TTL:g}` processes; the leader SIGKILLed -> the other's GET / "
        f"says it leads and its leader work runs: median {median(f):.1f} s, max {max(f):.1f} s "
        f"(bound: the lease, {FAILOVER_TTL:g} s, plus a renewal beat; with the default "
        "--leader-ttl 30 expect up to about 30 s, as istiod's Lease).",
    ]
    return lines

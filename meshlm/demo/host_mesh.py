"""What the scenarios across hosts (meshlm.demo.hosts) share: a control plane on host `cp`, runtime
hosts that join by registration, a caller host whose sidecar and traffic client run beside each
other, and the plumbing to drive them from outside (the control plane's admin API and the caller
Envoy's admin, each reached from inside its host).

A scenario subclasses `HostMesh`, gives `mesh_doc` and `scenario`, and runs it with `run_hosts`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshlm.demo.scenario import report_of, say, write_report

SERVICE = "llm"
CALLER_SA = "default/caller"
ACME_KEY_SHA256 = "a2fb8545fcd457204e9fee11be92013aa3240b1b146fe262ba608fdfc159041c"
ACME_KEY = "demo-acme-key"  # the demo tenant's published key (meshlm/demo/mesh.yaml)
MAX_NEW_TOKENS = 24


def run_scenario(title: str, produce: Callable[[], dict[str, Any]]) -> int:
    """A host scenario's `run`: 2 where namespaces cannot be made (never a fallback to
    loopback), 1 when the run failed or a goal does not hold, else 0."""
    from meshlm.demo.hosts import NamespacesUnavailable, check_prerequisites

    try:
        check_prerequisites()
    except NamespacesUnavailable as e:
        print(f"meshlm demo: {e}", file=sys.stderr)
        return 2
    report = report_of(title, produce)
    if report is None:
        return 1
    return 0 if all(report["goals"].values()) else 1


def run_hosts(
    hosts: tuple[str, ...], workdir: Path | None, make: Callable[..., HostMesh], timeout: float
) -> dict[str, Any]:
    """Make the hosts, run `make(net, workdir, id_dir, deadline)`'s scenario in them, delete
    them, and add to its report the namespaces and those of them still left."""
    from meshlm.demo.hosts import HostNetwork

    workdir = workdir or Path(tempfile.mkdtemp(prefix="meshlm-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"meshlm demo: logs and report in {workdir}", flush=True)
    id_dir = Path(tempfile.mkdtemp(prefix="meshlm-id-"))  # short: SDS socket paths
    started = time.monotonic()
    try:
        with HostNetwork(hosts) as net:
            say(f"hosts: {', '.join(f'{h.name} {h.address}' for h in net.hosts.values())}")
            report = make(net, workdir, id_dir, time.monotonic() + timeout).run()
        report["namespaces"] = sorted(h.netns for h in net.hosts.values())
        report["namespaces_left"] = _namespaces_left(net)
        report["run_s"] = round(time.monotonic() - started, 1)
        write_report(workdir, report)
        return report
    finally:
        shutil.rmtree(id_dir, ignore_errors=True)


def _namespaces_left(net: Any) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    mine = {h.netns for h in net.hosts.values()}
    return sorted(n.split()[0] for n in out.splitlines() if n and n.split()[0] in mine)


def mesh_base(
    ports: dict[str, int], caller_stats_url: str, services: dict[str, Any]
) -> dict[str, Any]:
    """The mesh file around `services`: registration across hosts, identity on, the Wasm authz
    filter and the demo tenant acme."""
    return {
        "control_plane": {
            "debounce": "100ms", "grpc_port": ports["grpc"], "admin_port": ports["admin"],
            "ca_port": ports["ca"], "ca_mtls_port": ports["ca_mtls"],
            "registration": {"enabled": True, "multi_host": True, "grace": "10s"},
        },
        "identity": {"trust_domain": "meshlm.local"},
        "services": services,
        "caller_sidecars": [{"admin_url": caller_stats_url}],
        "authz": {"mode": "wasm"},
        "tenants": {
            "acme": {
                "key_sha256": ACME_KEY_SHA256, "allow": [f"{SERVICE}/*"],
                "rate_limit": {"max_tokens": 40, "tokens_per_fill": 20, "fill_interval": "1s"},
            }
        },
    }  # fmt: skip


class HostMesh:
    """One run on a HostNetwork with hosts `cp`, `caller` and the runtime hosts, each
    `host -> (version, zone)`. `scenario()` is the run itself; `run()` stops every process
    after it, whatever happened."""

    runtime_hosts: dict[str, tuple[str, str]] = {}
    caller_zone: str | None = None

    def __init__(self, net: Any, workdir: Path, id_dir: Path, deadline: float) -> None:
        import secrets

        from mesh_common.ports import free_port

        self.net, self.workdir, self.id_dir, self.deadline = net, workdir, id_dir, deadline
        self.token = secrets.token_urlsafe(24)
        self.ports = {k: free_port() for k in ("grpc", "admin", "ca", "ca_mtls")}
        self.rt_ports = {k: free_port() for k in ("grpc", "http", "inbound", "admin")}
        self.caller_ports = {k: free_port() for k in ("outbound", "stats", "admin")}
        self.procs: dict[str, Any] = {}
        self.cp_thread: Any = None
        self.caller_thread: Any = None
        self.events: dict[str, float] = {}

    def mesh_doc(self, caller_stats_url: str) -> dict[str, Any]:
        raise NotImplementedError

    def scenario(self) -> dict[str, Any]:
        raise NotImplementedError

    def run(self) -> dict[str, Any]:
        try:
            return self.scenario()
        finally:
            self.stop_all()

    def start_hosts(self) -> dict[str, dict[str, Any]]:
        """Start the control plane, every runtime host and the caller; each runtime host's
        join times (`join_times`)."""
        self.start_control_plane()
        for host in self.runtime_hosts:
            self.start_runtime_host(host)
        self.start_caller()
        return {h: self.join_times(h) for h in self.runtime_hosts}

    def address(self, host: str) -> str:
        """HOST:PORT of a runtime host's inbound listener: its registered address and its
        runtime's replica id."""
        return f"{self.net[host].address}:{self.rt_ports['inbound']}"

    # -- starting ----------------------------------------------------------------------------
    def spawn(self, host: str, name: str, args: list[str], env: dict[str, str] | None = None):
        from meshlm.demo.host_procs import HostProc

        argv = args if args[0] == sys.executable else [sys.executable, "-m", "meshlm.cli", *args]
        proc = HostProc(self.net, host, name, argv, self.workdir, env)
        self.procs[name] = proc
        return proc

    def start_control_plane(self) -> None:
        import yaml

        from meshlm.demo.netns_thread import NamespaceThread

        cp = self.net["cp"]
        stats = f"http://{self.net['caller'].address}:{self.caller_ports['stats']}"
        mesh_file = self.workdir / "mesh.yaml"
        mesh_file.write_text(yaml.safe_dump(self.mesh_doc(stats), sort_keys=False))
        args = ["xds-server", "--mesh", str(mesh_file), "--grpc-host", cp.address]
        args += ["--state-dir", str(self.workdir / "state")]
        proc = self.spawn("cp", "xds-server", args, env={"MESHLM_ADMIN_TOKEN": self.token})
        self.cp_thread = NamespaceThread(cp.netns)
        self.until(lambda: self.admin("GET", "/debug/syncz"), 60, "the control plane", proc)
        say(
            f"control plane on {cp.name}: ADS and registration "
            f"{cp.address}:{self.ports['grpc']} (mTLS)"
        )

    def identity(self, name: str, sa: str) -> Any:
        from mesh_common.private_files import write_private
        from meshlm.demo.host_commands import Identity

        token = self.admin("POST", "/identity/tokens", {"service_account": sa, "ttl": "10m"})
        path = self.workdir / "join-tokens" / f"{name}.json"
        write_private(path, json.dumps(token).encode(), "join tokens")
        return Identity(join_token_file=path, identity_dir=self.id_dir / name)

    def start_runtime_host(self, host: str) -> None:
        from meshlm.demo.host_commands import runtime_host_commands

        version, zone = self.runtime_hosts[host]
        p = self.rt_ports
        cmds = runtime_host_commands(
            self.net[host].address, xds=f"{self.net['cp'].address}:{self.ports['grpc']}",
            service=SERVICE, version=version, grpc_port=p["grpc"], http_port=p["http"],
            inbound_port=p["inbound"], admin_port=p["admin"], zone=zone,
            identity=self.identity(host, f"default/{SERVICE}"),
            launcher=(sys.executable, "-m", "meshlm.cli"),
        )  # fmt: skip
        self.spawn(host, f"runtime-{host}", cmds.runtime, env={"OMP_NUM_THREADS": "1"})
        self.spawn(host, f"sidecar-{host}", cmds.sidecar)

    def start_caller(self) -> None:
        from meshlm.demo.netns_thread import NamespaceThread

        caller, p = self.net["caller"], self.caller_ports
        ident = self.identity("caller", CALLER_SA)
        args = [
            "sidecar", "--xds", f"{self.net['cp'].address}:{self.ports['grpc']}",
            "--node-id", "caller", "--listen-host", caller.address,
            "--outbound-port", str(p["outbound"]), "--stats-port", str(p["stats"]),
            "--admin-port", str(p["admin"]), "--identity",
            "--join-token-file", str(ident.join_token_file),
            "--identity-dir", str(ident.identity_dir),
        ]  # fmt: skip
        if self.caller_zone:
            args += ["--zone", self.caller_zone]
        proc = self.spawn("caller", "sidecar-caller", args)
        self.caller_thread = NamespaceThread(caller.netns)
        self.until(lambda: self.caller_admin("/ready") == "LIVE", 120, "the caller sidecar", proc)
        zone = f" in {self.caller_zone}" if self.caller_zone else ""
        say(f"caller sidecar on caller{zone}: {caller.address}:{p['outbound']} "
            f"(stats :{p['stats']})")  # fmt: skip

    def join_times(self, host: str) -> dict[str, Any]:
        """SERVING (the runtime's line) -> registered (the sidecar's) -> held by the caller's
        Envoy (the host's address among its cluster's endpoints)."""
        address = self.address(host)
        serving = self.procs[f"runtime-{host}"].wait_for(r"meshlm serve: SERVING", 300)
        registered = self.procs[f"sidecar-{host}"].wait_for(r"\bregistered " + address, 120)
        version, zone = self.runtime_hosts[host]
        self.until(lambda: address in self.caller_hosts(version), 60, f"{host} at the caller")
        acked = time.monotonic()
        say(
            f"{host} ({version}, {zone}) joined: SERVING -> registered "
            f"{registered - serving:.2f} s -> held by the caller {acked - registered:.2f} s"
        )
        return {
            "address": address, "version": version, "zone": zone,
            "serving_to_registered_s": round(registered - serving, 3),
            "registered_to_caller_acked_s": round(acked - registered, 3),
        }  # fmt: skip

    def load(self, host: str) -> tuple[float, float]:
        """The runtime's decode speed (measured inside `host`, straight to its runtime) and the
        call rate that asks about a third of one runtime's speed, within 0.5..3 calls/s."""
        argv = [sys.executable, "-m", "meshlm.demo.host_client", "capacity"]
        argv += ["--target", f"127.0.0.1:{self.rt_ports['grpc']}", "--tokens", "16"]
        done = self.net.run(host, argv, timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"capacity measurement failed: {done.stderr[-2000:]}")
        speed = json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"]
        rate = min(max(speed / 3 / MAX_NEW_TOKENS, 0.5), 3.0)
        return speed, rate

    def start_traffic(self, rate: float, out: Path, max_seconds: float | None = None) -> None:
        from meshlm.demo.host_client import API_KEY_ENV

        caller = self.net["caller"]
        left = max(30.0, self.deadline - time.monotonic())
        argv = [
            sys.executable, "-m", "meshlm.demo.host_client", "traffic",
            "--target", f"{caller.address}:{self.caller_ports['outbound']}",
            "--authority", SERVICE, "--tenant", "acme",
            "--rate", f"{rate:.3f}", "--max-new-tokens", str(MAX_NEW_TOKENS),
            "--max-seconds", str(left if max_seconds is None else min(left, max_seconds)),
            "--out", str(out),
        ]  # fmt: skip
        proc = self.spawn("caller", "traffic", argv, env={API_KEY_ENV: ACME_KEY})
        proc.wait_for("traffic: started", 60)
        say(f"traffic: acme {rate:.2f} calls/s from inside the caller host")

    def stop_traffic(self, out: Path) -> list[dict[str, Any]]:
        self.procs["traffic"].stop(timeout=90)
        return json.loads(out.read_text())

    def busy(self, host: str, wait: float = 10.0) -> int:
        """Wait until the caller's Envoy has a stream running on `host` (at most `wait` s);
        how many it has."""
        address = self.address(host)
        key = f"outbound|{SERVICE}|{self.runtime_hosts[host][0]}::{address}::rq_active::"
        deadline = time.monotonic() + wait
        while True:
            lines = self.caller_admin("/clusters").splitlines()
            active = next((int(x.rsplit(":", 1)[1]) for x in lines if x.startswith(key)), 0)
            if active or time.monotonic() > deadline:
                return active
            time.sleep(0.02)

    # -- plumbing ----------------------------------------------------------------------------
    def admin(self, method: str, path: str, body: Any = None) -> Any:
        from meshlm.admin_client import AdminClient, local_url

        def call() -> Any:
            client = AdminClient(local_url(self.ports["admin"]), token=self.token)
            code, reply = client.request(method, path, body, 30)
            if code >= 400:
                raise RuntimeError(f"{method} {path}: HTTP {code}: {json.dumps(reply)[:500]}")
            return reply

        return self.cp_thread.call(call)

    def caller_admin(self, path: str) -> str:
        def get() -> str:
            url = f"http://127.0.0.1:{self.caller_ports['admin']}{path}"
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.read().decode().strip()

        return self.caller_thread.call(get)

    def caller_hosts(self, version: str) -> set[str]:
        """HOST:PORT of the endpoints the caller's Envoy holds for the version's cluster."""
        doc = json.loads(self.caller_admin("/clusters?format=json"))
        hosts = set()
        for c in doc.get("cluster_statuses", []):
            if c["name"] == f"outbound|{SERVICE}|{version}":
                for h in c.get("host_statuses", []):
                    a = h["address"]["socket_address"]
                    hosts.add(f"{a['address']}:{a['port_value']}")
        return hosts

    def back(self, host: str) -> bool:
        """Whether the control plane holds an open registration stream of `host`, SERVING, and
        the caller's Envoy holds the host."""
        address = self.address(host)
        rows = self.admin("GET", "/debug/syncz")["registrations"]
        row = next((r for r in rows if r["address"] == address), None)
        return (
            row is not None
            and row.get("stream") == "open"
            and row.get("health") == "SERVING"
            and address in self.caller_hosts(self.runtime_hosts[host][0])
        )

    def until(self, check: Any, timeout: float, what: str, proc: Any = None) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and not proc.alive():
                raise RuntimeError(f"{proc.name} exited while waiting for {what}:\n{proc.tail()}")
            try:
                if result := check():
                    return result
            except Exception:
                pass  # not up yet
            time.sleep(0.1)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, min(seconds, self.deadline - time.monotonic())))

    def stop_all(self) -> None:
        order = ["traffic", "sidecar-caller", *(f"sidecar-{h}" for h in self.runtime_hosts)]
        order += [f"runtime-{h}" for h in self.runtime_hosts] + ["xds-server"]
        for name in order:
            if name in self.procs:
                self.procs[name].stop(timeout=15)
        for t in (self.cp_thread, self.caller_thread):
            if t is not None:
                t.close()
        say("all processes stopped")


def overlaps(call: dict[str, Any], start: float, end: float) -> bool:
    """Whether the call ran at some time in [start, end] (driver's monotonic clock)."""
    return call["at"] <= end and call["at"] + call["latency_ms"] / 1000 >= start


def calls_summary(calls: list[dict[str, Any]]) -> dict[str, Any]:
    from meshlm.demo.sla import percentile

    latency = [c["latency_ms"] for c in calls]
    return {
        "total": len(calls),
        "ok": sum(c["status"] == "OK" for c in calls),
        "by_status": dict(Counter(c["status"] for c in calls)),
        "by_replica": dict(Counter(c["replica"] or "-" for c in calls)),
        "resumed": sum(c["resumes"] > 0 for c in calls),
        "latency_ms_p50": percentile(latency, 50),
        "latency_ms_p99": percentile(latency, 99),
        "latency_ms_max": round(max(latency), 1) if latency else None,
    }

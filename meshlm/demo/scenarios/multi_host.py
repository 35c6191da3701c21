"""`meshlm demo --scenario multi-host`: the mesh across hosts, each a Linux network namespace
with its own address on a bridge (meshlm.demo.hosts).

Host `cp` runs the control plane; `h1`, `h2` (v1) and `h3` (v2) each run a runtime on their own
loopback and a sidecar whose inbound listener binds the host's address and which joins the
service by registration (the mesh file lists no endpoint of theirs); host `caller` runs the
caller sidecar and, beside it, the traffic client (meshlm.demo.host_client), as a pod's
container would. Every hop between hosts is sidecar to sidecar over mTLS with SPIFFE
certificates, the registration streams and the rollout gates' reads included (the gates read the
caller's counters through its read-only stats listener). Traffic scaled to the runtime's
measured speed runs while the control plane rolls v2 out; meanwhile h1 is cut off (blackhole
routes) and healed, then h2 scales in: its sidecar is sent SIGTERM (it deregisters, waits for
the callers to drop it, drains), and only then its runtime stops. Exit 0 when every goal holds;
2 where network namespaces cannot be made (never a fallback to loopback).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from meshlm.demo.scenario import report_of, say, write_report

SERVICE = "llm"
CALLER_SA = "default/caller"
# host -> (version, zone)
RUNTIME_HOSTS = {"h1": ("v1", "zone-a"), "h2": ("v1", "zone-b"), "h3": ("v2", "zone-c")}
PARTITIONED, SCALED_IN = "h1", "h2"
HOSTS = ("cp", *RUNTIME_HOSTS, "caller")
MAX_NEW_TOKENS = 24
PARTITION_S = 8.0
AVAILABILITY_GOAL = 99.9
ACME_KEY_SHA256 = "a2fb8545fcd457204e9fee11be92013aa3240b1b146fe262ba608fdfc159041c"
ACME_KEY = "demo-acme-key"  # the demo tenant's published key (meshlm/demo/mesh.yaml)
STALL = {"gap": "1s", "consecutive": 3, "hard_limit": "5s", "max_resumes": 2}
ROLLOUT = {
    "stable": "v1", "canary": "v2", "steps": [20, 50, 100], "interval": "10s", "threshold": 2,
    "gates": {"grpc_success_rate_min": 99.0, "min_requests": 3},
}  # fmt: skip


def run(args: argparse.Namespace, name: str) -> int:
    from meshlm.demo.hosts import NamespacesUnavailable, check_prerequisites

    try:
        check_prerequisites()
    except NamespacesUnavailable as e:
        print(f"meshlm demo: {e}", file=sys.stderr)
        return 2
    report = report_of(
        "multi-host: a rollout across hosts, a partition and a scale-in under traffic",
        lambda: _run(args.workdir, min(args.timeout, 600.0)),
    )
    if report is None:
        return 1
    return 0 if all(report["goals"].values()) else 1


def mesh_doc(ports: dict[str, int], caller_stats_url: str) -> dict[str, Any]:
    """The mesh file: no endpoint of any runtime (they register), identity on."""
    return {
        "control_plane": {
            "debounce": "100ms", "grpc_port": ports["grpc"], "admin_port": ports["admin"],
            "ca_port": ports["ca"], "ca_mtls_port": ports["ca_mtls"],
            "registration": {"enabled": True, "multi_host": True, "grace": "10s"},
        },
        "identity": {"trust_domain": "meshlm.local"},
        "services": {
            SERVICE: {
                "service_account": f"default/{SERVICE}",
                "versions": {v: {"precision": "int4", "endpoints": []} for v in ("v1", "v2")},
                "route": {"weights": {"v1": 100, "v2": 0}, "stream_idle_timeout": "60s"},
                "outlier_detection": {
                    "consecutive_gateway_failure": 2, "consecutive_5xx": 5, "interval": "1s",
                    "base_ejection_time": "10s", "max_ejection_percent": 50,
                },
                "retry_policy": {
                    "retry_on": "unavailable,connect-failure,refused-stream", "num_retries": 2,
                },
                "health_check": {
                    "interval": "1s", "timeout": "1s", "unhealthy_threshold": 2,
                    "healthy_threshold": 1,
                },
                "stall": dict(STALL),
            }
        },
        "caller_sidecars": [{"admin_url": caller_stats_url}],
        "authz": {"mode": "wasm"},
        "tenants": {
            "acme": {
                "key_sha256": ACME_KEY_SHA256, "allow": [f"{SERVICE}/*"],
                "rate_limit": {"max_tokens": 40, "tokens_per_fill": 20, "fill_interval": "1s"},
            }
        },
        "rollouts": {SERVICE: dict(ROLLOUT)},
    }  # fmt: skip


def _run(workdir: Path | None, timeout: float) -> dict[str, Any]:
    from meshlm.demo.hosts import HostNetwork

    workdir = workdir or Path(tempfile.mkdtemp(prefix="meshlm-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"meshlm demo: logs and report in {workdir}", flush=True)
    id_dir = Path(tempfile.mkdtemp(prefix="meshlm-id-"))  # short: SDS socket paths
    started = time.monotonic()
    try:
        with HostNetwork(HOSTS) as net:
            say(f"hosts: {', '.join(f'{h.name} {h.address}' for h in net.hosts.values())}")
            report = _Demo(net, workdir, id_dir, time.monotonic() + timeout).run()
        report["namespaces"] = sorted(h.netns for h in net.hosts.values())
        report["namespaces_left"] = _namespaces_left(net)
        report["run_s"] = round(time.monotonic() - started, 1)
        write_report(workdir, report)
        return report
    finally:
        shutil.rmtree(id_dir, ignore_errors=True)


def _namespaces_left(net: Any) -> list[str]:
    import subprocess

    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    mine = {h.netns for h in net.hosts.values()}
    return sorted(n.split()[0] for n in out.splitlines() if n and n.split()[0] in mine)


class _Demo:
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
        self.history_seen = 0  # rollout transitions printed
        self.h1_active = 0

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        try:
            return self._run()
        finally:
            self._stop_all()

    def _run(self) -> dict[str, Any]:
        self._start_control_plane()
        for host in RUNTIME_HOSTS:
            self._start_runtime_host(host)
        self._start_caller()
        joins = {h: self._join_times(h) for h in RUNTIME_HOSTS}
        registered = {r["address"]: r for r in self._admin("GET", "/debug/syncz")["registrations"]}
        say(f"registered: {', '.join(sorted(registered))}")
        capacity, rate = self._load()
        say(
            f"runtime decodes {capacity:.0f} tokens/s: "
            f"{rate:.2f} calls/s of {MAX_NEW_TOKENS} tokens"
        )
        out = self.workdir / "calls.json"
        self._start_traffic(rate, out)
        time.sleep(4)
        status = self._admin("POST", f"/rollouts/{SERVICE}", {})
        spec = status["spec"]
        say(f"rollout {spec['stable']} -> {spec['canary']}, steps {spec['steps']}")
        self._sleep(2)
        self.h1_active = self._partition(PARTITIONED)
        say(
            f"{PARTITIONED} partitioned (blackhole routes both ways) for {PARTITION_S:g} s, "
            f"{self.h1_active} stream(s) running there"
        )
        self._sleep(PARTITION_S)
        self.net.heal(PARTITIONED)
        self.events["heal"] = time.monotonic()
        say(f"{PARTITIONED} healed")
        h1 = f"{self.net[PARTITIONED].address}:{self.rt_ports['inbound']}"
        # Its registration stream either outlived the cut (no keepalive fell inside it) or broke
        # and registers again: either way the host is back once the control plane holds an open
        # stream for it, SERVING, and the caller's Envoy has it again.
        self._until(lambda: self._back(h1), 60, f"{PARTITIONED} back in the pool after the heal")
        self.events["back_in_pool"] = time.monotonic()
        self._sleep(2)
        self._wait_rollout(lambda s: s["state"] in TERMINAL or _weight(s) >= 50)
        scale_in = self._scale_in(SCALED_IN)
        status = self._wait_rollout(lambda s: s["state"] in TERMINAL)
        self._sleep(3)  # calls after the last step
        calls = self._stop_traffic(out)
        return self._report(joins, registered, capacity, rate, status, scale_in, calls)

    # -- starting ----------------------------------------------------------------------------
    def _spawn(self, host: str, name: str, args: list[str], env: dict[str, str] | None = None):
        from meshlm.demo.host_procs import HostProc

        argv = args if args[0] == sys.executable else [sys.executable, "-m", "meshlm.cli", *args]
        proc = HostProc(self.net, host, name, argv, self.workdir, env)
        self.procs[name] = proc
        return proc

    def _start_control_plane(self) -> None:
        import yaml

        from meshlm.demo.netns_thread import NamespaceThread

        cp = self.net["cp"]
        stats = f"http://{self.net['caller'].address}:{self.caller_ports['stats']}"
        mesh_file = self.workdir / "mesh.yaml"
        mesh_file.write_text(yaml.safe_dump(mesh_doc(self.ports, stats), sort_keys=False))
        args = ["xds-server", "--mesh", str(mesh_file), "--grpc-host", cp.address]
        args += ["--state-dir", str(self.workdir / "state")]
        proc = self._spawn("cp", "xds-server", args, env={"MESHLM_ADMIN_TOKEN": self.token})
        self.cp_thread = NamespaceThread(cp.netns)
        self._until(lambda: self._admin("GET", "/debug/syncz"), 60, "the control plane", proc)
        say(
            f"control plane on {cp.name}: ADS and registration "
            f"{cp.address}:{self.ports['grpc']} (mTLS)"
        )

    def _identity(self, name: str, sa: str) -> Any:
        from mesh_common.private_files import write_private
        from meshlm.demo.host_commands import Identity

        token = self._admin("POST", "/identity/tokens", {"service_account": sa, "ttl": "10m"})
        path = self.workdir / "join-tokens" / f"{name}.json"
        write_private(path, json.dumps(token).encode(), "join tokens")
        return Identity(join_token_file=path, identity_dir=self.id_dir / name)

    def _start_runtime_host(self, host: str) -> None:
        from meshlm.demo.host_commands import runtime_host_commands

        version, zone = RUNTIME_HOSTS[host]
        p = self.rt_ports
        cmds = runtime_host_commands(
            self.net[host].address, xds=f"{self.net['cp'].address}:{self.ports['grpc']}",
            service=SERVICE, version=version, grpc_port=p["grpc"], http_port=p["http"],
            inbound_port=p["inbound"], admin_port=p["admin"], zone=zone,
            identity=self._identity(host, f"default/{SERVICE}"),
            launcher=(sys.executable, "-m", "meshlm.cli"),
        )  # fmt: skip
        self._spawn(host, f"runtime-{host}", cmds.runtime, env={"OMP_NUM_THREADS": "1"})
        self._spawn(host, f"sidecar-{host}", cmds.sidecar)

    def _start_caller(self) -> None:
        from meshlm.demo.netns_thread import NamespaceThread

        caller, p = self.net["caller"], self.caller_ports
        ident = self._identity("caller", CALLER_SA)
        args = [
            "sidecar", "--xds", f"{self.net['cp'].address}:{self.ports['grpc']}",
            "--node-id", "caller", "--listen-host", caller.address,
            "--outbound-port", str(p["outbound"]), "--stats-port", str(p["stats"]),
            "--admin-port", str(p["admin"]), "--identity",
            "--join-token-file", str(ident.join_token_file),
            "--identity-dir", str(ident.identity_dir),
        ]  # fmt: skip
        proc = self._spawn("caller", "sidecar-caller", args)
        self.caller_thread = NamespaceThread(caller.netns)
        self._until(lambda: self._caller_admin("/ready") == "LIVE", 120, "the caller sidecar", proc)
        say(f"caller sidecar on caller: {caller.address}:{p['outbound']} (stats :{p['stats']})")

    def _join_times(self, host: str) -> dict[str, Any]:
        """SERVING (the runtime's line) -> registered (the sidecar's) -> held by the caller's
        Envoy (the host's address among its cluster's endpoints)."""
        address = f"{self.net[host].address}:{self.rt_ports['inbound']}"
        serving = self.procs[f"runtime-{host}"].wait_for(r"meshlm serve: SERVING", 300)
        registered = self.procs[f"sidecar-{host}"].wait_for(r"\bregistered " + address, 120)
        version = RUNTIME_HOSTS[host][0]
        self._until(lambda: address in self._caller_hosts(version), 60, f"{host} at the caller")
        acked = time.monotonic()
        say(f"{host} ({version}) joined: SERVING -> registered {registered - serving:.2f} s -> "
            f"held by the caller {acked - registered:.2f} s")  # fmt: skip
        return {
            "address": address, "version": version, "zone": RUNTIME_HOSTS[host][1],
            "serving_to_registered_s": round(registered - serving, 3),
            "registered_to_caller_acked_s": round(acked - registered, 3),
        }  # fmt: skip

    def _load(self) -> tuple[float, float]:
        """The runtime's decode speed (measured inside h3, straight to its runtime) and the
        call rate that asks about a third of one runtime's speed, within 0.5..3 calls/s."""
        argv = [sys.executable, "-m", "meshlm.demo.host_client", "capacity"]
        argv += ["--target", f"127.0.0.1:{self.rt_ports['grpc']}", "--tokens", "16"]
        done = self.net.run("h3", argv, timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"capacity measurement failed: {done.stderr[-2000:]}")
        speed = json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"]
        rate = min(max(speed / 3 / MAX_NEW_TOKENS, 0.5), 3.0)
        return speed, rate

    def _start_traffic(self, rate: float, out: Path) -> None:
        from meshlm.demo.host_client import API_KEY_ENV

        caller = self.net["caller"]
        argv = [
            sys.executable, "-m", "meshlm.demo.host_client", "traffic",
            "--target", f"{caller.address}:{self.caller_ports['outbound']}",
            "--authority", SERVICE, "--tenant", "acme",
            "--rate", f"{rate:.3f}", "--max-new-tokens", str(MAX_NEW_TOKENS),
            "--max-seconds", str(max(30.0, self.deadline - time.monotonic())), "--out", str(out),
        ]  # fmt: skip
        proc = self._spawn("caller", "traffic", argv, env={API_KEY_ENV: ACME_KEY})
        proc.wait_for("traffic: started", 60)
        say(f"traffic: acme {rate:.2f} calls/s from inside the caller host")

    def _stop_traffic(self, out: Path) -> list[dict[str, Any]]:
        self.procs["traffic"].stop(timeout=90)
        return json.loads(out.read_text())

    # -- faults ------------------------------------------------------------------------------
    def _busy(self, host: str, wait: float = 10.0) -> int:
        """Wait until the caller's Envoy has a stream running on `host` (at most `wait` s);
        how many it has."""
        address = f"{self.net[host].address}:{self.rt_ports['inbound']}"
        key = f"outbound|{SERVICE}|{RUNTIME_HOSTS[host][0]}::{address}::rq_active::"
        deadline = time.monotonic() + wait
        while True:
            lines = self._caller_admin("/clusters").splitlines()
            active = next((int(x.rsplit(":", 1)[1]) for x in lines if x.startswith(key)), 0)
            if active or time.monotonic() > deadline:
                return active
            time.sleep(0.02)

    def _partition(self, host: str) -> int:
        """Cut `host` off mid-stream; how many streams the caller's Envoy had running there."""
        active = self._busy(host)
        self.events["partition"] = time.monotonic()
        self.net.partition(host, "blackhole")
        return active

    def _scale_in(self, host: str) -> dict[str, Any]:
        """SIGTERM the host's sidecar (deregister, callers drop it, drain), then its runtime."""
        sidecar, runtime = self.procs[f"sidecar-{host}"], self.procs[f"runtime-{host}"]
        address = f"{self.net[host].address}:{self.rt_ports['inbound']}"
        active = self._busy(host)
        self.events["scale_in"] = t0 = time.monotonic()
        say(f"{host} scales in: SIGTERM to its sidecar, {active} stream(s) running there")
        rc = sidecar.stop(timeout=60)
        t1 = time.monotonic()
        runtime.stop(timeout=30)
        self.events["scale_in_done"] = t2 = time.monotonic()
        dereg = sidecar.first(r"deregistered " + address)
        gone = address not in self._caller_hosts(RUNTIME_HOSTS[host][0])
        say(
            f"{host}: sidecar exited ({rc}) after {t1 - t0:.1f} s, "
            f"runtime after {t2 - t1:.1f} s more"
        )
        return {
            "host": host, "address": address, "streams_running_on_it": active,
            "sidecar_exit": rc,
            "deregistered_s": None if dereg is None else round(dereg - t0, 3),
            "deregistration_line": sidecar.first(r"deregistered ") is not None,
            "sidecar_exited_after_s": round(t1 - t0, 3),
            "runtime_stopped_after_s": round(t2 - t1, 3),
            "caller_dropped_it": gone,
        }  # fmt: skip

    # -- the rollout -------------------------------------------------------------------------
    def _wait_rollout(self, done: Any) -> dict[str, Any]:
        while True:
            s = self._admin("GET", f"/rollouts/{SERVICE}")
            for h in s["history"][self.history_seen :]:
                say(f"rollout -> {h['to']} canary {h['canary_weight']}%  {h['reason']}")
            self.history_seen = len(s["history"])
            if done(s):
                return s
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"rollout still {s['state']}: {s['message']}")
            time.sleep(0.5)

    # -- the report --------------------------------------------------------------------------
    def _report(
        self, joins: dict, registered: dict, capacity: float, rate: float,
        status: dict, scale_in: dict, calls: list[dict[str, Any]],
    ) -> dict[str, Any]:  # fmt: skip
        ok = sum(c["status"] == "OK" for c in calls)
        availability = 100.0 * ok / len(calls) if calls else 0.0
        ev = self.events
        window = (ev["scale_in"] - 0.5, ev["scale_in_done"] + 5)
        lost = [c for c in calls if c["status"] != "OK" and _overlaps(c, *window)]
        static = [e for v in mesh_doc(self.ports, "")["services"][SERVICE]["versions"].values()
                  for e in v["endpoints"]]  # fmt: skip
        joined = {j["address"] for j in joins.values()}
        h1 = f"{self.net[PARTITIONED].address}:{self.rt_ports['inbound']}"
        rejoined = self.procs[f"sidecar-{PARTITIONED}"].first_after(
            r"\bregistered " + h1, ev["heal"]
        )
        back = ev.get("back_in_pool")
        rollout_steps = [
            {"to": h["to"], "canary_weight": h["canary_weight"], "reason": h["reason"]}
            for h in status["history"]
        ]
        t0 = min((c["at"] for c in calls), default=ev["partition"])
        report = {
            "workdir": str(self.workdir),
            "hosts": {h.name: h.address for h in self.net.hosts.values()},
            "joins": joins,
            "endpoints_in_mesh_file": static,
            "registered_at_control_plane": sorted(registered),
            "capacity_tokens_per_s": round(capacity, 1),
            "rate_calls_per_s": round(rate, 3),
            "max_new_tokens": MAX_NEW_TOKENS,
            "calls": _calls(calls),
            "availability_percent": round(availability, 3),
            "events_s_after_first_call": {k: round(v - t0, 2) for k, v in ev.items()},
            "partition": {
                "host": PARTITIONED, "mode": "blackhole", "seconds": PARTITION_S,
                "streams_running_on_it": self.h1_active,
                "calls_in_flight_at_the_cut": _at_cut(calls, ev["partition"], h1),
                "back_in_pool_s_after_heal": None if back is None else round(back - ev["heal"], 2),
                "registered_again": rejoined is not None,
            },
            "scale_in": {**scale_in, "calls_lost": len(lost),
                         "lost_by_status": dict(Counter(c["status"] for c in lost))},
            "rollout": {"state": status["state"], "message": status["message"],
                        "steps": rollout_steps},
        }  # fmt: skip
        cut = report["partition"]["calls_in_flight_at_the_cut"]
        counted = sum(v for k, v in cut.items() if k != "total")
        report["goals"] = {
            "every_runtime_host_registered": not static and joined <= set(registered),
            "rollout_succeeded": status["state"] == "Succeeded",
            f"availability_at_least_{AVAILABILITY_GOAL}": availability >= AVAILABILITY_GOAL,
            "none_lost_by_the_drain": not lost and scale_in["sidecar_exit"] == 0,
            "partitioned_streams_counted": counted == cut["total"],
        }
        return report

    # -- plumbing ----------------------------------------------------------------------------
    def _admin(self, method: str, path: str, body: Any = None) -> Any:
        from meshlm.admin_client import AdminClient, local_url

        def call() -> Any:
            client = AdminClient(local_url(self.ports["admin"]), token=self.token)
            code, reply = client.request(method, path, body, 30)
            if code >= 400:
                raise RuntimeError(f"{method} {path}: HTTP {code}: {json.dumps(reply)[:500]}")
            return reply

        return self.cp_thread.call(call)

    def _caller_admin(self, path: str) -> str:
        def get() -> str:
            url = f"http://127.0.0.1:{self.caller_ports['admin']}{path}"
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.read().decode().strip()

        return self.caller_thread.call(get)

    def _back(self, address: str) -> bool:
        rows = self._admin("GET", "/debug/syncz")["registrations"]
        row = next((r for r in rows if r["address"] == address), None)
        return (
            row is not None
            and row.get("stream") == "open"
            and row.get("health") == "SERVING"
            and address in self._caller_hosts(RUNTIME_HOSTS[PARTITIONED][0])
        )

    def _caller_hosts(self, version: str) -> set[str]:
        """HOST:PORT of the endpoints the caller's Envoy holds for the version's cluster."""
        doc = json.loads(self._caller_admin("/clusters?format=json"))
        hosts = set()
        for c in doc.get("cluster_statuses", []):
            if c["name"] == f"outbound|{SERVICE}|{version}":
                for h in c.get("host_statuses", []):
                    a = h["address"]["socket_address"]
                    hosts.add(f"{a['address']}:{a['port_value']}")
        return hosts

    def _until(self, check: Any, timeout: float, what: str, proc: Any = None) -> Any:
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

    def _sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, min(seconds, self.deadline - time.monotonic())))

    def _stop_all(self) -> None:
        order = ["traffic", "sidecar-caller", *(f"sidecar-{h}" for h in RUNTIME_HOSTS)]
        order += [f"runtime-{h}" for h in RUNTIME_HOSTS] + ["xds-server"]
        for name in order:
            if name in self.procs:
                self.procs[name].stop(timeout=15)
        for t in (self.cp_thread, self.caller_thread):
            if t is not None:
                t.close()
        say("all processes stopped")


TERMINAL = ("Succeeded", "RolledBack", "Failed")


def _overlaps(call: dict[str, Any], start: float, end: float) -> bool:
    """Whether the call ran at some time in [start, end] (driver's monotonic clock)."""
    return call["at"] <= end and call["at"] + call["latency_ms"] / 1000 >= start


def _weight(status: dict[str, Any]) -> int:
    return status["history"][-1]["canary_weight"] if status["history"] else 0


def _calls(calls: list[dict[str, Any]]) -> dict[str, Any]:
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


def _at_cut(calls: list[dict[str, Any]], t: float, host: str) -> dict[str, int]:
    """The calls running when the host was cut off, each counted once: finished there before
    the cut took hold, resumed mid-stream, answered by another host, or failed (by status)."""
    out: Counter[str] = Counter()
    for c in calls:
        if not _overlaps(c, t, t):
            continue
        out["total"] += 1
        if c["status"] != "OK":
            out[f"failed_{c['status']}"] += 1
        elif c["resumes"]:
            out["resumed"] += 1
        elif c["replica"] == host:
            out["finished_on_it"] += 1
        else:
            out["answered_by_another_host"] += 1
    return {"total": 0, **out}

"""The local mesh: control plane, two runtime versions each behind its sidecar, and a
caller-side sidecar, as real processes on loopback (the same commands a user runs by hand)."""

from __future__ import annotations

import copy
import json
import os
import secrets
import shlex
import shutil
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh_common.ports import free_port
from mesh_common.private_files import write_private
from meshlm.admin_client import AdminClient, local_url
from meshlm.demo.crashloop import CrashLoopBackoff
from meshlm.demo.identity import CertWatch
from meshlm.demo.procs import Proc, wait_until

SERVICE = "llm"
MESH_ID_ENV = "MESHLM_MESH_ID"
# The identity the demo's caller sidecar gets (its join token grants it).
CALLER_SERVICE_ACCOUNT = "default/caller"


def demo_mesh() -> dict[str, Any]:
    return yaml.safe_load(resources.files("meshlm.demo").joinpath("mesh.yaml").read_text())


def scenario_mesh(weights: dict[str, int]) -> dict[str, Any]:
    """The demo mesh with only these int4 versions at these weights and no rollout: where the
    SLA scenarios start (LocalMesh fills in the endpoints and metrics URLs)."""
    mesh = demo_mesh()
    svc = mesh["services"][SERVICE]
    svc["versions"] = {v: {"precision": "int4", "endpoints": []} for v in weights}
    svc["route"] = {**svc["route"], "weights": dict(weights)}
    mesh.pop("rollouts", None)
    # The SLA scenarios stay plaintext, as `python -m bench sla` measures them, and the SLO
    # loop's scaler starts sidecars without join tokens.
    mesh.pop("identity", None)
    return mesh


@dataclass
class Runtime:
    """One runtime replica and its inbound sidecar. Its name is the version when the version
    has one replica, `<version>-<i>` when it has several."""

    version: str
    precision: str
    name: str = ""
    port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)  # its OpenAI HTTP API
    metrics_port: int = field(default_factory=free_port)
    inbound_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    budget_port: int = field(default_factory=free_port)  # its sidecar's token budget listener


class LocalMesh:
    def __init__(
        self,
        mesh: dict[str, Any] | None = None,
        *,
        workdir: Path | None = None,
        faults: dict[str, list[str]] | None = None,
        replicas: dict[str, int] | None = None,
        torch_threads: int = 1,
        scaler_serve_args: list[str] | None = None,
    ) -> None:
        """`faults` maps a runtime name or a version to extra `meshlm serve` arguments;
        `replicas` maps a version to its number of runtime replicas (default 1);
        `scaler_serve_args`, when given, runs the control plane with `--scaler local`: the SLO
        loop's new replicas run `meshlm serve` with these arguments."""
        self.mesh = copy.deepcopy(mesh or demo_mesh())
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="meshlm-demo-"))
        self.faults = faults or {}
        self.torch_threads = torch_threads
        self.scaler_serve_args = scaler_serve_args
        self.token = secrets.token_urlsafe(24)
        self.grpc_port, self.admin_port = free_port(), free_port()
        self.caller_port, self.caller_admin = free_port(), free_port()
        versions = self.mesh["services"][SERVICE]["versions"]
        self.runtimes: dict[str, Runtime] = {}
        for v, cfg in versions.items():
            n = (replicas or {}).get(v, 1)
            for i in range(n):
                name = v if n == 1 else f"{v}-{i}"
                self.runtimes[name] = Runtime(v, cfg.get("precision", "int4"), name)
        # Callers reach a version through its sidecars' inbound listeners; the rollout gates
        # read the runtimes' metrics and the caller's Envoy stats where this mesh file says, only.
        for v in versions:
            mine = self.replicas(v)
            versions[v]["endpoints"] = [f"127.0.0.1:{rt.inbound_port}" for rt in mine]
            versions[v]["metrics_urls"] = [
                f"http://127.0.0.1:{rt.metrics_port}/metrics.json" for rt in mine
            ]
        self.mesh["caller_sidecars"] = [{"admin_url": self.caller_admin_url()}]
        for ro in self.mesh.get("rollouts", {}).values():
            q = ro.get("quality")
            if q and q.get("mode", "replay") == "replay":  # replays through this caller sidecar
                q["replay_via"] = self.caller_target
        self.control_plane_env: dict[str, str] = {}  # e.g. the quality replay's key
        self.mesh["control_plane"] = {
            **self.mesh.get("control_plane", {}),
            "grpc_port": self.grpc_port,
            "admin_port": self.admin_port,
        }
        # With an `identity` block every sidecar gets a SPIFFE certificate: the mesh
        # CA's ports, and a private dir per sidecar for its key and SDS socket, short enough for
        # a unix socket path whatever the work dir (removed at stop).
        self.identity_dir: Path | None = None
        self.certs: CertWatch | None = None
        if self.identity:
            self.mesh["control_plane"].update(ca_port=free_port(), ca_mtls_port=free_port())
            self.identity_dir = Path(tempfile.mkdtemp(prefix="meshlm-id-"))
        self.procs: list[Proc] = []
        self.restarts: dict[str, int] = {}  # runtime name -> restarts by keep_runtimes_alive
        # runtime name or version -> its niceness: a best-effort pool (e.g. the quarantine pool a
        # query of death keeps killing) reloads its model without starving the healthy ones.
        self.nice: dict[str, int] = {}
        self._stopping = threading.Event()
        self._restarting = threading.Lock()  # a restart and stop() never interleave

    @property
    def identity(self) -> bool:
        return "identity" in self.mesh

    def sidecar_admin_ports(self) -> dict[str, int]:
        """Each sidecar's process name -> its Envoy admin port."""
        ports = {f"sidecar-{n}": rt.admin_port for n, rt in self.runtimes.items()}
        return {**ports, "sidecar-caller": self.caller_admin}

    def service_account(self) -> str:
        """The service account of the service's inbound sidecars (the mesh file's default)."""
        return self.mesh["services"][SERVICE].get("service_account", f"default/{SERVICE}")

    def replicas(self, version: str) -> list[Runtime]:
        return [rt for rt in self.runtimes.values() if rt.version == version]

    def replica_versions(self) -> dict[str, str]:
        """Each runtime's x-meshlm-replica (`meshlm serve`'s default: its gRPC HOST:PORT) ->
        its version: which version answered a call, as the caller sees it."""
        return {f"127.0.0.1:{rt.port}": rt.version for rt in self.runtimes.values()}

    def serve_args(self, rt: Runtime) -> list[str]:
        """The `meshlm serve` command line of one replica (its faults included): gRPC, and the
        OpenAI HTTP API serving the model as the service's names (served_model_names)."""
        names = served_model_names(self.mesh["services"][SERVICE], SERVICE)
        args = ["serve", "--precision", rt.precision, "--port", str(rt.port)]
        args += ["--http-port", str(rt.http_port), "--served-model-name", *names]
        args += ["--metrics-port", str(rt.metrics_port)]
        # Token budgets: mesh-wide ones through its sidecar; its own tier outlives a restart.
        args += ["--budget-service", f"127.0.0.1:{rt.budget_port}"]
        args += ["--token-budget-state", str(self.workdir / f"budgets-{rt.name}.json")]
        return args + self.faults.get(rt.name, self.faults.get(rt.version, []))

    @property
    def admin_url(self) -> str:
        # https:// once the control plane (a mesh with identity) published its CA
        return local_url(self.admin_port)

    @property
    def caller_target(self) -> str:
        return f"127.0.0.1:{self.caller_port}"

    def caller_admin_url(self) -> str:
        return f"http://127.0.0.1:{self.caller_admin}"

    def start(self, say: Any = print) -> None:
        mesh_file = self.workdir / "mesh.yaml"
        mesh_file.write_text(yaml.safe_dump(self.mesh, sort_keys=False))
        env = {"MESHLM_ADMIN_TOKEN": self.token, **self.control_plane_env}
        # Its CA and rollouts live and die with this mesh's work dir.
        args = ["xds-server", "--mesh", str(mesh_file), "--state-dir", str(self.workdir / "state")]
        if self.scaler_serve_args is not None:  # its replicas inherit the environment
            args += ["--scaler", "local", "--scaler-serve-args", shlex.join(self.scaler_serve_args)]
            env["OMP_NUM_THREADS"] = str(self.torch_threads)
        cp = self._spawn("xds-server", args, env=env)
        wait_until(lambda: self.admin("GET", "/debug/syncz"), 60, "the control plane", cp)
        say(f"control plane up: ADS 127.0.0.1:{self.grpc_port}, admin {self.admin_url}")
        say(f"dashboard: {self.admin_url}/dashboard/ (live until the demo ends)")
        for name in self.runtimes:
            self._spawn_runtime(name)
        for name, rt in self.runtimes.items():
            self._spawn(f"sidecar-{name}", self._sidecar_args(rt) + self._identity_args(name))
        self._spawn("sidecar-caller", self._caller_args() + self._identity_args("caller"))
        for name, rt in self.runtimes.items():
            proc = self.proc(f"runtime-{name}")
            wait_until(lambda rt=rt: _serving(rt.port), 180, f"runtime {name} SERVING", proc)
            say(f"runtime {name} ({rt.precision}) SERVING on 127.0.0.1:{rt.port}")
        for name, port in self.sidecar_admin_ports().items():
            wait_until(lambda p=port: _envoy_live(p), 60, f"{name} ready", self.proc(name))
        say(f"sidecars ready: caller on {self.caller_target}, inbound for {list(self.runtimes)}")
        if self.identity:
            dirs = {f"sidecar-{n}": self.identity_dir / n for n in [*self.runtimes, "caller"]}
            self.certs = CertWatch(dirs).start()
            ids = sorted(set(self.certs.wait_all(60).values()))
            say(f"workload identities (SPIFFE, mTLS certificates by SDS): {', '.join(ids)}")

    def restart_runtime(self, name: str, faults: list[str], say: Any = print) -> Proc:
        """Stop one replica's runtime and start it again on the same ports with `faults` (a
        scenario's way to change a fault mid-run); returns once it serves. A runtime that then
        exits by itself stays down unless keep_runtimes_alive() runs."""
        with self._restarting:
            old = self.proc(f"runtime-{name}")
            old.stop()
            self.procs.remove(old)
            self.faults[name] = faults
            proc = self._spawn_runtime(name)
        port = self.runtimes[name].port
        wait_until(lambda: _serving(port), 180, f"runtime {name} SERVING", proc)
        say(f"runtime {name} restarted with {' '.join(faults) or 'no faults'}")
        return proc

    def keep_runtimes_alive(
        self, say: Any = print, backoff: CrashLoopBackoff | None = None
    ) -> None:
        """From now on, restart any runtime that exits by itself (same ports and arguments), as
        a pod's `restartPolicy: Always` would, with its CrashLoopBackOff (`backoff`, default
        1 s doubling to 60 s, reset after 120 s up); `restarts` counts them per runtime. The
        sidecar in front of it keeps running and health-checks it back in."""
        template = backoff or CrashLoopBackoff()
        backoffs = {name: copy.copy(template) for name in self.runtimes}
        started = dict.fromkeys(self.runtimes, time.monotonic())
        due: dict[str, float] = {}  # a dead runtime -> when it is restarted

        def loop() -> None:
            while not self._stopping.wait(0.2):
                for name in list(self.runtimes):
                    with self._restarting:
                        old = self.proc(f"runtime-{name}")
                        if old.alive() or self._stopping.is_set():
                            continue
                        now = time.monotonic()
                        if name not in due:
                            delay = backoffs[name].after_exit(now - started[name])
                            due[name] = now + delay
                            rc = old.popen.poll()
                            say(f"runtime {name} exited ({rc}); restart in {delay:g} s")
                        if now < due[name]:
                            continue
                        del due[name]
                        self.procs.remove(old)
                        self._spawn_runtime(name)
                        started[name] = time.monotonic()
                        self.restarts[name] = self.restarts.get(name, 0) + 1
                    say(f"runtime {name} restarted")

        threading.Thread(target=loop, name="keep-runtimes-alive", daemon=True).start()

    def _spawn_runtime(self, name: str) -> Proc:
        threads = {"OMP_NUM_THREADS": str(self.torch_threads)}
        rt = self.runtimes[name]
        proc = self._spawn(f"runtime-{name}", self.serve_args(rt), env=threads)
        nice = self.nice.get(name, self.nice.get(rt.version, 0))
        if nice and proc.popen is not None:
            os.setpriority(os.PRIO_PROCESS, proc.popen.pid, nice)
        return proc

    def _identity_args(self, name: str) -> list[str]:
        """`meshlm sidecar`'s identity flags for the sidecar `name` (a runtime's or `caller`):
        a join token of its own, asked of the admin API, kept only in a 0600 file of the work
        dir (single use; never on a command line)."""
        if self.identity_dir is None:
            return []
        sa = CALLER_SERVICE_ACCOUNT if name == "caller" else self.service_account()
        token = self.admin("POST", "/identity/tokens", {"service_account": sa, "ttl": "10m"})
        path = self.workdir / "join-tokens" / f"{name}.json"  # its dir: made 0700
        write_private(path, json.dumps(token).encode(), "join tokens")
        return [
            "--identity", "--join-token-file", str(path),
            "--identity-dir", str(self.identity_dir / name),
        ]  # fmt: skip

    def _sidecar_args(self, rt: Runtime) -> list[str]:
        return [
            "sidecar", "--xds", f"127.0.0.1:{self.grpc_port}",
            "--node-id", f"{SERVICE}-{rt.name}", "--service", SERVICE, "--version", rt.version,
            "--inbound-port", str(rt.inbound_port), "--local-endpoint", f"127.0.0.1:{rt.port}",
            "--local-http-endpoint", f"127.0.0.1:{rt.http_port}",
            "--admin-port", str(rt.admin_port), "--budget-port", str(rt.budget_port),
            "--lkg-file", str(self.workdir / f"lkg-{rt.name}.json"),
        ]  # fmt: skip

    def _caller_args(self) -> list[str]:
        return [
            "sidecar", "--xds", f"127.0.0.1:{self.grpc_port}", "--node-id", "caller",
            "--outbound-port", str(self.caller_port), "--admin-port", str(self.caller_admin),
            "--lkg-file", str(self.workdir / "lkg-caller.json"),
        ]  # fmt: skip

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        # Inherited by every descendant (Envoys too), so a leftover can be traced to this mesh.
        env = {MESH_ID_ENV: str(self.workdir), **(env or {})}
        proc = Proc.meshlm(name, args, self.workdir, env=env).start()
        self.procs.append(proc)
        return proc

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def admin(self, method: str, path: str, body: Any = None, timeout: float = 60) -> Any:
        admin = AdminClient(self.admin_url, token=self.token)
        code, reply = admin.request(method, path, body, timeout)
        if code >= 400:  # the control plane's reason, not just the code
            raise RuntimeError(f"{method} {path}: HTTP {code}: {json.dumps(reply)[:500]}")
        return reply

    def envoy_stats(self, admin_port: int, regex: str) -> dict[str, int]:
        url = f"http://127.0.0.1:{admin_port}/stats?format=json&filter={regex}"
        with urllib.request.urlopen(url, timeout=5) as r:
            stats = json.loads(r.read())["stats"]
        return {s["name"]: s["value"] for s in stats if "value" in s}

    def stop(self) -> None:
        # Callers first, then sidecars, runtimes, control plane: nothing is left behind.
        with self._restarting:
            self._stopping.set()
        if self.certs is not None:
            self.certs.stop()
        for proc in reversed(self.procs):
            proc.stop()
        if self.identity_dir is not None:  # the sidecars' private keys
            shutil.rmtree(self.identity_dir, ignore_errors=True)


def served_model_names(service: dict[str, Any], name: str) -> list[str]:
    """`meshlm serve --served-model-name` for a runtime of mesh service `name`: the service's
    `model` and `aliases`, the names a caller sidecar routes to it by (so the runtime accepts
    every one of them), else the service's name (a call's `model` is `llm`)."""
    model = service.get("model")
    return [model, *service.get("aliases", [])] if model else [name]


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return resp.status == health_pb2.HealthCheckResponse.SERVING


def _envoy_live(admin_port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=2) as r:
        return r.read().strip() == b"LIVE"

"""Real processes for the chaos scenarios: the control plane (`meshlm xds-server`), sidecars
(`meshlm sidecar`: supervised Envoy), runtimes (`meshlm serve`), and tiny grpcio upstreams whose
latency and error rate can be changed while they serve. Every process is stopped by `stop()`."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer

from mesh_common.ports import free_port
from meshlm.demo.procs import Proc, wait_until

ECHO = "/meshlm.inference.v1.Inference/Who"  # inside the API an `llm/*` rule allows
TOKEN = "chaos-admin-token-" + "x" * 16


class EchoUpstream:
    """A grpcio server answering any unary call with its name, after `delay_s`, failing
    `error_percent` % of calls with UNAVAILABLE; grpc.health.v1 SERVING."""

    def __init__(self, name: str, *, workers: int = 32) -> None:
        self.name = name
        self.delay_s = 0.0
        self.error_percent = 0.0
        self.calls = 0
        self._lock = threading.Lock()
        self._rng = random.Random(7)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.server.add_generic_rpc_handlers((self,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method.startswith("/grpc.health"):
            return None
        return grpc.unary_unary_rpc_method_handler(self._who)

    def _who(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self._lock:
            self.calls += 1
            fail = self._rng.random() * 100 < self.error_percent
        if self.delay_s:
            time.sleep(self.delay_s)
        if fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: injected fault")
        return self.name.encode()

    def stop(self) -> None:
        self.server.stop(0).wait(5)


def echo_call(port: int, service: str = "llm", *, key: str | None = None, timeout: float = 10):
    """A `call()` for `Load`: one unary echo call through the Envoy listener on `port`."""
    channel = grpc.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.default_authority", service)]
    )
    stub = channel.unary_unary(ECHO)
    md = (("x-api-key", key),) if key else ()

    def call(timeout: float = timeout) -> str:
        return stub(b"", metadata=md, timeout=timeout).decode()

    call.channel = channel  # type: ignore[attr-defined]
    return call


class Mesh:
    """The processes of one scenario, all under `workdir`, all stopped by `stop()`."""

    def __init__(self, workdir: Path, mesh: dict[str, Any]) -> None:
        self.workdir = workdir
        self.mesh_file = workdir / "mesh.yaml"
        self.grpc_port, self.admin_port = free_port(), free_port()
        mesh = dict(mesh)
        mesh["control_plane"] = {
            "grpc_port": self.grpc_port,
            "admin_port": self.admin_port,
            "debounce": "20ms",
        }
        self.mesh = mesh
        self.write_mesh(mesh)
        self.procs: dict[str, Proc] = {}

    def write_mesh(self, mesh: dict[str, Any]) -> None:
        self.mesh = mesh
        self.mesh_file.write_text(yaml.safe_dump(mesh, sort_keys=False))

    # -- processes ----------------------------------------------------------------------------
    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        old = self.procs.get(name)
        if old is not None:
            old.stop()
        proc = Proc.meshlm(name, args, self.workdir, env=env).start()
        self.procs[name] = proc
        return proc

    def start_control_plane(self) -> Proc:
        store = self.workdir / "rollouts.json"
        args = ["xds-server", "--mesh", str(self.mesh_file), "--rollout-store", str(store),
                "--state-dir", str(self.workdir / "state")]  # fmt: skip
        proc = self.spawn("xds-server", args, env={"MESHLM_ADMIN_TOKEN": TOKEN})
        wait_until(lambda: self.admin("GET", "/debug/syncz")[0] == 200, 60, "control plane", proc)
        return proc

    def kill(self, name: str) -> None:
        self.procs[name].stop(timeout=5, sig=signal.SIGKILL)

    def start_sidecar(self, name: str, *, admin_port: int, **ports: Any) -> Proc:
        args = ["sidecar", "--xds", f"127.0.0.1:{self.grpc_port}", "--node-id", name]
        args += ["--admin-port", str(admin_port), "--lkg-file", str(self.workdir / f"{name}.lkg")]
        for k, v in ports.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        proc = self.spawn(name, args)
        wait_until(lambda: envoy_live(admin_port), 60, f"{name} ready", proc)
        return proc

    def start_runtime(self, name: str, port: int, *extra: str) -> Proc:
        args = ["serve", "--precision", "int4", "--port", str(port), *extra]
        return self.spawn(name, args, env={"OMP_NUM_THREADS": "1"})

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop(timeout=10)

    # -- the admin API ------------------------------------------------------------------------
    def admin(
        self, method: str, path: str, body: Any = None, *, token: str | None = TOKEN
    ) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.admin_port}{path}", data=data, method=method
        )
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")


def envoy_live(admin_port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=2) as r:
        return r.read().strip() == b"LIVE"


def envoy_stats(admin_port: int, regex: str) -> dict[str, int]:
    url = f"http://127.0.0.1:{admin_port}/stats?format=json&filter={regex}"
    with urllib.request.urlopen(url, timeout=5) as r:
        stats = json.loads(r.read())["stats"]
    return {s["name"]: s["value"] for s in stats if "value" in s}


def serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return resp.status == health_pb2.HealthCheckResponse.SERVING


def children(pid: int) -> list[int]:
    """Direct child processes of `pid` (Linux /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def kill_pid(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)

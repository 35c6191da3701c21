"""How the SLO loop adds and removes replicas: `scale_out(service, version)` starts one and
returns the endpoint callers reach it at (its inbound sidecar, host:port); `scale_in` stops it.

- `CommandScaler` runs the operator's commands (e.g. a `kubectl scale` wrapper): the scale-out
  command prints the new endpoint as its last line; both get MESHLM_SERVICE, MESHLM_VERSION
  (and MESHLM_ENDPOINT for scale-in) in their environment, never on a shell line.
- `LocalScaler` starts `meshlm serve` and its `meshlm sidecar` on loopback, as the local mesh
  does (processes, not imports: the control plane never imports the CLI or torch).

A scaler may also have `metrics_url(endpoint)`: the new runtime's `GET /metrics.json`, which the SLO
loop reads beside the version's metrics_urls (None: not known).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.ports import free_port
from xds_server.mesh import parse_endpoint

START_TIMEOUT_S = 180.0  # a runtime loads its model before it serves


class ScalerError(RuntimeError):
    """A replica could not be started or stopped; the message says why."""


class Scaler(Protocol):
    def scale_out(self, service: str, version: str) -> str: ...

    def scale_in(self, service: str, version: str, endpoint: str) -> None: ...


class CommandScaler:
    def __init__(self, out_cmd: str, in_cmd: str, *, timeout: float = START_TIMEOUT_S) -> None:
        self.out_cmd, self.in_cmd, self.timeout = shlex.split(out_cmd), shlex.split(in_cmd), timeout

    def _run(self, argv: list[str], env: dict[str, str]) -> str:
        try:
            done = subprocess.run(
                argv, env={**os.environ, **env}, capture_output=True, text=True,
                timeout=self.timeout, check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ScalerError(f"{argv[0]}: {e}") from None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
            raise ScalerError(f"{argv[0]} exited {done.returncode}: {tail[0]}")
        return done.stdout

    def scale_out(self, service: str, version: str) -> str:
        out = self._run(self.out_cmd, {"MESHLM_SERVICE": service, "MESHLM_VERSION": version})
        lines = out.strip().splitlines()
        if not lines:
            raise ScalerError(f"{self.out_cmd[0]}: printed no endpoint (host:port)")
        try:
            return str(parse_endpoint(lines[-1].strip(), "scale-out command output"))
        except ValueError as e:
            raise ScalerError(str(e)) from None

    def scale_in(self, service: str, version: str, endpoint: str) -> None:
        env = {"MESHLM_SERVICE": service, "MESHLM_VERSION": version, "MESHLM_ENDPOINT": endpoint}
        self._run(self.in_cmd, env)


class LocalScaler:
    """Replicas as local processes: `meshlm serve` + `meshlm sidecar` (inbound) per replica."""

    def __init__(
        self,
        xds: str,
        *,
        serve_args: Sequence[str] = (),
        workdir: str | None = None,
        timeout: float = START_TIMEOUT_S,
    ) -> None:
        self.xds, self.serve_args, self.timeout = xds, list(serve_args), timeout
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="meshlm-scaler-"))
        self.procs: dict[str, list[subprocess.Popen]] = {}
        self.metrics: dict[str, str] = {}  # endpoint -> its runtime's GET /metrics.json
        self.count = 0

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "meshlm.cli", *args],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def scale_out(self, service: str, version: str) -> str:
        self.count += 1
        name = f"{service}-{version}-scaled-{self.count}"
        port, metrics, inbound, admin = (free_port() for _ in range(4))
        runtime = self._spawn(
            f"runtime-{name}",
            ["serve", "--port", str(port), "--metrics-port", str(metrics), *self.serve_args],
        )
        sidecar = self._spawn(
            f"sidecar-{name}",
            ["sidecar", "--xds", self.xds, "--node-id", name, "--service", service,
             "--version", version, "--inbound-port", str(inbound),
             "--local-endpoint", f"127.0.0.1:{port}", "--admin-port", str(admin)],
        )  # fmt: skip
        endpoint = f"127.0.0.1:{inbound}"
        self.procs[endpoint] = [sidecar, runtime]
        deadline = time.monotonic() + self.timeout
        # SERVING, not only listening: a runtime answers /metrics while its model still loads,
        # and EDS would send it calls it cannot take.
        while not (_live(admin) and _serving(port)):
            dead = [p for p in (runtime, sidecar) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.scale_in(service, version, endpoint)
                why = "exited" if dead else f"not ready after {self.timeout:.0f}s"
                raise ScalerError(f"replica {name} {why} (logs in {self.workdir})")
            time.sleep(0.5)
        self.metrics[endpoint] = f"http://127.0.0.1:{metrics}/metrics.json"
        return endpoint

    def metrics_url(self, endpoint: str) -> str | None:
        return self.metrics.get(endpoint)

    def scale_in(self, service: str, version: str, endpoint: str) -> None:
        self.metrics.pop(endpoint, None)
        for p in self.procs.pop(endpoint, []):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _live(admin_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=2) as r:
            return r.read().strip() == b"LIVE"
    except OSError:
        return False


def _serving(port: int) -> bool:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            req = health_pb2.HealthCheckRequest()
            resp = health_pb2_grpc.HealthStub(ch).Check(req, timeout=2)
    except grpc.RpcError:
        return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING

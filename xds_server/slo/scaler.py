"""How the SLO loop adds and removes replicas: `scale_out(service, version)` starts one and
returns the endpoint callers reach it at (its inbound sidecar, host:port); `scale_in` stops it.

- `CommandScaler` runs the operator's commands (e.g. a `kubectl scale` wrapper): the scale-out
  command prints the new endpoint as its last line; both get MESHLM_SERVICE, MESHLM_VERSION
  (and MESHLM_ENDPOINT for scale-in) in their environment, never on a shell line.
- `LocalScaler` starts `meshlm serve` and its `meshlm sidecar` on loopback, as the local mesh
  does (processes, not imports: the control plane never imports the CLI or torch). On a mesh
  whose hops are mTLS the sidecar gets `--identity` and a join token for the service's
  service_account, issued in-process by the control plane's mesh CA (`join_tokens`) and handed
  over in a 0600 file, never on a command line.

A scaler may also have `metrics_url(endpoint)`: the new runtime's `GET /metrics.json`, which the SLO
loop reads beside the version's metrics_urls (None: not known).
"""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh_common.child_env import child_env
from mesh_common.ports import free_port
from mesh_common.private_files import write_private
from xds_server.mesh import parse_endpoint

if TYPE_CHECKING:
    from xds_server import mesh as m
    from xds_server.identity.workload import Identity

START_TIMEOUT_S = 180.0  # a runtime loads its model before it serves
JOIN_TOKEN_TTL_S = 600.0  # the sidecar enrols as it starts; single use anyway

# service -> a join token for its service_account (the answer of POST /identity/tokens), or
# None when the mesh's sidecars need no certificate.
JoinTokens = Callable[[str], "dict[str, Any] | None"]


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
                argv, env=child_env(env), capture_output=True, text=True,
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
        join_tokens: JoinTokens | None = None,
    ) -> None:
        self.xds, self.serve_args, self.timeout = xds, list(serve_args), timeout
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="meshlm-scaler-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.join_tokens = join_tokens
        self.procs: dict[str, list[subprocess.Popen]] = {}
        self.private: dict[str, list[Path]] = {}  # endpoint -> its join token, its identity dir
        self._identity_root: Path | None = None
        self.metrics: dict[str, str] = {}  # endpoint -> its runtime's GET /metrics.json
        self.count = 0

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "meshlm.cli", *args], env=child_env(),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def scale_out(self, service: str, version: str) -> str:
        self.count += 1
        name = f"{service}-{version}-scaled-{self.count}"
        port, metrics, inbound, admin = (free_port() for _ in range(4))
        endpoint = f"127.0.0.1:{inbound}"
        identity = self._identity_args(service, name, endpoint)
        runtime = self._spawn(
            f"runtime-{name}",
            ["serve", "--port", str(port), "--metrics-port", str(metrics), *self.serve_args],
        )
        sidecar = self._spawn(
            f"sidecar-{name}",
            ["sidecar", "--xds", self.xds, "--node-id", name, "--service", service,
             "--version", version, "--inbound-port", str(inbound),
             "--local-endpoint", f"127.0.0.1:{port}", "--admin-port", str(admin), *identity],
        )  # fmt: skip
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

    def _identity_args(self, service: str, name: str, endpoint: str) -> list[str]:
        """`meshlm sidecar`'s identity flags for replica `name` ([] when the mesh needs none):
        its join token in a 0600 file of the workdir, its key in a private dir of a short path
        (the SDS socket's path holds 107 bytes); both removed at scale_in."""
        token = self.join_tokens(service) if self.join_tokens else None
        if token is None:
            return []
        if self._identity_root is None:
            self._identity_root = Path(tempfile.mkdtemp(prefix="meshlm-id-"))
        token_file = self.workdir / "join-tokens" / f"{name}.json"
        identity_dir = self._identity_root / name
        try:
            write_private(token_file, json.dumps(token).encode(), "join tokens")
        except (OSError, ValueError) as e:  # PrivateFileError: a workdir others can read
            raise ScalerError(f"replica {name}: cannot write its join token: {e}") from None
        self.private[endpoint] = [token_file, identity_dir]
        return ["--identity", "--join-token-file", str(token_file),
                "--identity-dir", str(identity_dir)]  # fmt: skip

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
        for path in self.private.pop(endpoint, []):  # a spent join token, a private key
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if not self.private and self._identity_root is not None:
            shutil.rmtree(self._identity_root, ignore_errors=True)
            self._identity_root = None


class WithMeshCA(Protocol):
    """What the scaler reads of the control plane (an XdsServer): its mesh, its mesh CA and
    whether ADS requires mTLS."""

    @property
    def mesh(self) -> m.Mesh: ...

    identity: Identity | None
    ads_mtls: bool


def control_plane_join_tokens(cp: WithMeshCA) -> JoinTokens:
    """Join tokens from `cp`'s own mesh CA (its admin API's POST
    /identity/tokens, in-process) for each service's service_account, when the mesh's hops are
    mTLS (ADS too: a sidecar without a certificate is refused)."""

    def issue(service: str) -> dict[str, Any] | None:
        if cp.identity is None or not cp.ads_mtls:
            return None
        sa = cp.mesh.services[service].service_account
        body = json.dumps({"service_account": sa, "ttl": JOIN_TOKEN_TTL_S}).encode()
        status, doc = cp.identity.handle("POST", "/identity/tokens", body)
        if status != 200:
            raise ScalerError(f"join token for {sa}: {doc.get('error', status)}")
        return doc

    return issue


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

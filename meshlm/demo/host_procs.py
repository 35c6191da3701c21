"""Processes the multi-host demo starts inside its hosts (meshlm.demo.hosts.HostNetwork): each
one's output goes to its log file, every line stamped with the driver's monotonic clock, so the
demo can tell when a line first appeared (a runtime SERVING, a sidecar registered)."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from mesh_common.child_env import child_env
from mesh_common.process_group import stop_group
from meshlm.demo.hosts import HostNetwork


class HostProc:
    def __init__(
        self,
        net: HostNetwork,
        host: str,
        name: str,
        argv: list[str],
        logdir: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.host, self.name = host, name
        self.log_path = logdir / f"{name}.log"
        self._lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self.popen = net.popen(
            host, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env(env)
        )
        self._reader = threading.Thread(target=self._read, name=f"log-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with open(self.log_path, "a", encoding="utf-8") as log:
            for raw in self.popen.stdout:
                t = time.monotonic()
                line = raw.decode(errors="replace").rstrip("\n")
                with self._lock:
                    self._lines.append((t, line))
                log.write(f"{t:.3f} {line}\n")
                log.flush()

    def first(self, pattern: str) -> float | None:
        """The driver's monotonic time of the first output line matching `pattern`, or None."""
        rx = re.compile(pattern)
        with self._lock:
            return next((t for t, line in self._lines if rx.search(line)), None)

    def first_after(self, pattern: str, t: float) -> float | None:
        """The time of the first line matching `pattern` at or after `t`, or None."""
        rx = re.compile(pattern)
        with self._lock:
            return next((s for s, line in self._lines if s >= t and rx.search(line)), None)

    def wait_for(self, pattern: str, timeout: float, after: float = 0.0) -> float:
        """The time of the first line matching `pattern` at or after `after`, waiting for it."""
        deadline = time.monotonic() + timeout
        while (t := self.first_after(pattern, after)) is None:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited ({self.popen.poll()}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name}: no {pattern!r} after {timeout:.0f}s:\n{self.tail()}"
                )
            time.sleep(0.05)
        return t

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 15.0, sig: int = signal.SIGTERM) -> int | None:
        stop_group(self.popen, timeout, sig)
        self._reader.join(timeout=5)
        return self.popen.returncode

    def tail(self, n: int = 20) -> str:
        with self._lock:
            return "\n".join(line for _, line in self._lines[-n:])

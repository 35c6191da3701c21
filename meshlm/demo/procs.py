"""Child processes of the local mesh: each in its own process group with its own log file, so
that stopping the mesh stops everything it started, Envoys included."""

from __future__ import annotations

import atexit
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mesh_common.child_env import child_env
from mesh_common.process_group import stop_group

_ALL: list[Proc] = []


@atexit.register
def _stop_all() -> None:
    for p in reversed(_ALL):
        p.stop(timeout=5)


class Proc:
    def __init__(self, name: str, argv: list[str], logdir: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = argv
        self.log_path = logdir / f"{name}.log"
        self.env = child_env(env)  # a secret only where `env` names it
        self.popen: subprocess.Popen[bytes] | None = None

    @classmethod
    def meshlm(cls, name: str, args: list[str], logdir: Path, **kw: Any) -> Proc:
        """`meshlm ARGS` with this interpreter (works without the venv's bin on PATH)."""
        return cls(name, [sys.executable, "-m", "meshlm.cli", *args], logdir, **kw)

    def start(self) -> Proc:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        _ALL.append(self)
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 15.0, sig: int = signal.SIGTERM) -> None:
        if self.popen is not None:
            stop_group(self.popen, timeout, sig)

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def wait_until(
    check: Callable[[], Any], timeout: float, what: str, proc: Proc | None = None
) -> Any:
    """Poll `check` until it returns something true; fail with `what` and the process's log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited while waiting for {what}:\n{proc.tail()}")
        try:
            result = check()
            if result:
                return result
        except Exception:
            pass  # not up yet
        time.sleep(0.2)
    log = f":\n{proc.tail()}" if proc else ""
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{log}")

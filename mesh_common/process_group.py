"""Children that do not outlive their parent: stop one that runs in its own process group
(started with `start_new_session=True`), and have one killed when its parent dies."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)


def stop_group(popen: subprocess.Popen, timeout: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """`sig` to the whole group, then SIGKILL if it has not exited within `timeout`."""
    if popen.poll() is not None:
        return
    try:
        os.killpg(popen.pid, sig)
        popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()
    except ProcessLookupError:
        pass


def die_with(parent: int) -> Callable[[], None]:
    """A `preexec_fn`: the child gets SIGKILL when the thread that started it dies, so a
    supervisor killed by SIGKILL leaves no child behind (prctl(2), PR_SET_PDEATHSIG)."""

    def preexec() -> None:
        if _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:
            os._exit(127)  # the parent already died between fork and prctl

    return preexec

"""Stop a child that runs in its own process group (started with `start_new_session=True`)."""

from __future__ import annotations

import os
import signal
import subprocess


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

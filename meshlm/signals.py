"""Long-running commands (xds-server, serve, sidecar) stop cleanly on SIGINT or SIGTERM."""

from __future__ import annotations

import signal
import threading


def termination_event() -> threading.Event:
    """An event set by the first SIGINT or SIGTERM; wait on it, then shut down in order."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop

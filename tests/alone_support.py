"""The `alone` mark under pytest-xdist (`pytest -n 2`, see conftest.py): a test marked so runs
while no other worker runs a test. The workers of one run share a readers-writer lock on a file:
every test holds it shared, an `alone` test exclusive. POSIX record locks on two bytes of that
file: byte 0 is a turnstile each test passes through, so that a waiting `alone` test (which
holds it while it waits) is not starved by the other worker's stream of shared holders; byte 1
is the lock itself. The kernel drops a dead worker's locks."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

_TURNSTILE, _LOCK = 0, 1


class RunLock:
    """One worker's handle on its run's lock file (`testrunuid` names the run)."""

    def __init__(self, testrunuid: str) -> None:
        self.path = Path(tempfile.gettempdir()) / f"meshlm-tests-{testrunuid}.lock"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)

    def _lockf(self, op: int, byte: int) -> None:
        fcntl.lockf(self._fd, op, 1, byte)

    @contextlib.contextmanager
    def hold(self, *, alone: bool) -> Iterator[None]:
        self._lockf(fcntl.LOCK_EX, _TURNSTILE)
        try:
            self._lockf(fcntl.LOCK_EX if alone else fcntl.LOCK_SH, _LOCK)
        finally:
            self._lockf(fcntl.LOCK_UN, _TURNSTILE)
        try:
            yield
        finally:
            self._lockf(fcntl.LOCK_UN, _LOCK)

    def close(self) -> None:
        """Closes this handle; the first worker to finish removes the file (the others' open
        handles keep locking the same file, and no worker opens it again)."""
        os.close(self._fd)
        self.path.unlink(missing_ok=True)

"""The run lock behind the `alone` mark (tests/alone_support.py), between two real processes as
between two xdist workers: an `alone` holder keeps the other's tests out until it lets go."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid

from tests.alone_support import RunLock

HOLDER = """
import sys
from tests.alone_support import RunLock
lock = RunLock(sys.argv[1])
with lock.hold(alone=sys.argv[2] == "alone"):
    print("held", flush=True)
    sys.stdin.readline()
"""


def _other_worker(run: str, kind: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, run, kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert p.stdout.readline() == "held\n"
    return p


def _held_while(
    lock: RunLock, *, alone: bool, other: subprocess.Popen[str], wait_s: float = 1.0
) -> bool:
    """Whether this worker got the lock within `wait_s` while `other` still held its own."""
    got = threading.Event()

    def take() -> None:
        with lock.hold(alone=alone):
            got.set()

    t = threading.Thread(target=take)
    t.start()
    held_meanwhile = got.wait(wait_s)
    other.communicate("go\n", timeout=20)
    assert got.wait(20), "never got the lock after the other worker let go"
    t.join()
    return held_meanwhile


def test_an_alone_test_keeps_the_other_workers_tests_out_until_it_ends() -> None:
    run = uuid.uuid4().hex
    lock = RunLock(run)
    try:
        assert not _held_while(lock, alone=False, other=_other_worker(run, "alone"))
        assert not _held_while(lock, alone=True, other=_other_worker(run, "shared"))
        assert _held_while(lock, alone=False, other=_other_worker(run, "shared"), wait_s=20)
    finally:
        lock.close()

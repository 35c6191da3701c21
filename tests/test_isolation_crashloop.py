"""A runtime that keeps dying is restarted with a CrashLoopBackOff (issue 11 follow-up): a query
of death arriving every second must not make the launcher reload a model every few seconds."""

from __future__ import annotations

import os
import time

from meshlm.demo.crashloop import CrashLoopBackoff
from meshlm.demo.launcher import LocalMesh


def test_backoff_doubles_to_its_cap_and_a_stable_run_resets_it() -> None:
    b = CrashLoopBackoff(initial=1, cap=8, stable=120)
    assert [b.after_exit(ran_for=5) for _ in range(6)] == [1, 2, 4, 8, 8, 8]
    assert b.after_exit(ran_for=120) == 1
    assert b.after_exit(ran_for=3) == 2


def test_a_crash_looping_runtime_is_restarted_ever_later(tmp_path) -> None:
    # A real `meshlm serve` that exits at once (a bad flag), restarted by the launcher.
    mesh = LocalMesh(
        workdir=tmp_path, replicas={"v1": 1, "v2": 0}, faults={"v1": ["--precision", "bogus"]}
    )
    restarts_at: list[float] = []
    try:
        mesh._spawn_runtime("v1")
        start = time.monotonic()
        mesh.keep_runtimes_alive(say=lambda m: None, backoff=CrashLoopBackoff(initial=1, cap=60))
        while len(restarts_at) < 3 and time.monotonic() - start < 60:
            if mesh.restarts.get("v1", 0) > len(restarts_at):
                restarts_at.append(time.monotonic())
            time.sleep(0.02)
    finally:
        mesh.stop()
    gaps = [b - a for a, b in zip([start, *restarts_at], restarts_at, strict=False)]
    assert len(gaps) == 3, gaps
    # Each wait is at least the backoff's (the process's own run only adds to it).
    assert all(g >= want for g, want in zip(gaps, (1, 2, 4), strict=True)), gaps
    assert mesh.restarts == {"v1": 3}


def test_a_best_effort_pool_runs_at_its_niceness(tmp_path) -> None:
    mesh = LocalMesh(workdir=tmp_path, replicas={"v1": 1, "v2": 1})
    mesh.nice = {"v2": 10}
    try:
        # Real `meshlm serve` processes, checked while they load their model.
        pool, main = mesh._spawn_runtime("v2"), mesh._spawn_runtime("v1")
        assert os.getpriority(os.PRIO_PROCESS, pool.popen.pid) == 10
        assert os.getpriority(os.PRIO_PROCESS, main.popen.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        mesh.stop()

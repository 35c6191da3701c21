"""torch's parallel work on one thread at a time (model_runtime/engine/omp.py): a thread that ran
a parallel region keeps an OpenMP pool (worker threads) until it ends, and two pools on 2 cores
halve decode speed. Pools are counted as the OS threads of a fresh process with 2 torch
threads (this test process's own threads hold pools already)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from model_runtime.engine.omp import own_thread

COUNT = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    torch.set_num_threads(2)
    from model_runtime.engine.omp import own_thread

    def count():
        return len(os.listdir("/proc/self/task"))

    def settled(start):
        # the count once back at `start`, or after 5 s: an ended thread's pool is freed by its
        # TLS destructor, after join() returned
        deadline = time.monotonic() + 5
        while count() > start and time.monotonic() < deadline:
            time.sleep(0.01)
        return count()

    def parallel():
        return float(torch.ones(20_000_000).sum())  # well over one grain: a parallel region

    out = {"start": count()}
    own_thread(parallel)
    out["own_thread"] = settled(out["start"])
    if sys.argv[1] == "engine":
        from model_runtime.engine.engine import Engine
        from model_runtime.loading.loader import load
        lm = own_thread(load, precision="int4")
        out["loaded"] = settled(out["start"])
        engine = Engine(lm)  # allocates its KV cache
        out["engine_built"] = settled(out["start"])
    parallel()
    out["main"] = count()
    print(json.dumps(out))
    """
)


def _counts(mode: str) -> dict[str, int]:
    run = subprocess.run(
        [sys.executable, "-c", COUNT, mode], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_work_on_its_own_thread_leaves_no_pool_behind():
    n = _counts("plain")
    assert n["own_thread"] == n["start"]
    # the same work on the main thread leaves its pool's worker: the count does see pools
    assert n["main"] == n["start"] + 1, n


def test_a_model_loaded_and_an_engine_built_leave_the_callers_thread_without_a_pool():
    n = _counts("engine")
    assert n["loaded"] == n["start"], n
    assert n["engine_built"] == n["start"], n


def test_own_thread_returns_the_result_and_raises_the_error():
    assert own_thread(lambda a, b=1: a + b, 2, b=3) == 5
    with pytest.raises(ZeroDivisionError):
        own_thread(lambda: 1 / 0)

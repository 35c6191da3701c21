"""Warm-up before a runtime reports SERVING: the first calls must not pay for lazy initialisation.

A fresh process's first forward passes set up what later ones reuse (oneDNN builds a kernel for each
new matmul shape, i.e. each decode batch size and prefill length; allocator pools; lazy imports), so
a cold runtime's first call costs more CPU and a longer TTFT than a warm one; in a rollout that call
lands in the canary's first analysis interval and becomes its p99. So `meshlm serve` runs `warm_up`
between loading the model and turning healthy: `max_batch` greedy requests submitted at once, each
long enough to stay until the last is admitted, so decode runs at every batch size from 1 up to
max_batch and back."""

from __future__ import annotations

import threading
import time
from typing import Any

from model_runtime.engine.engine import GenerateParams

PROMPT = "Count from one to twenty."  # a long answer: no request ends before the last starts


def warm_up(engine: Any, tokenizer: Any, timeout: float = 120.0) -> int:
    """Run the warm-up through a started engine; returns the tokens it generated. Raises
    RuntimeError if a request fails or the warm-up takes longer than `timeout` seconds."""
    ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    n = engine.max_batch_limit
    left, tokens, errors = [n], [0], []
    done = threading.Event()
    lock = threading.Lock()

    def on_event(ev: Any) -> None:
        with lock:
            tokens[0] += len(ev.token_ids)
            if ev.finish_reason is None:
                return
            if ev.finish_reason in ("error", "cancelled"):
                errors.append(ev.error or ev.finish_reason)
            left[0] -= 1
            if not left[0]:
                done.set()

    stamp = time.monotonic_ns()
    for i in range(n):
        params = GenerateParams(list(ids), max_new_tokens=n + 1)
        engine.submit(f"warm-up-{stamp}-{i}", params, on_event)
    if not done.wait(timeout):
        raise RuntimeError(f"warm-up did not finish within {timeout:g}s")
    if errors:
        raise RuntimeError(f"warm-up failed: {errors[0]}")
    return tokens[0]

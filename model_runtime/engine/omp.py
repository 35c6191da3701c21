"""Keep torch's parallel work on one thread at a time.

torch's OpenMP runtime (its bundled libgomp) gives every thread that starts a parallel region a
pool of worker threads of its own, kept until that thread ends. Once the pools hold more threads
than there are CPUs, libgomp stops spinning at barriers (its "throttled" spin count, which no
environment variable raises): every barrier of every parallel region then sleeps and wakes
through the kernel. The native decode step and torch's ops enter hundreds of parallel regions a
step, so on a small CPU a second pool costs a large share of decode speed (BENCHMARKS.md: the
runtime section's note on OpenMP pools).

So work that may enter a parallel region outside the Engine's thread (loading a model, a
benchmark's bare forward) runs on a thread of its own, whose pool ends with it: `own_thread`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def own_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on a new thread that ends when it returns (and with it the OpenMP
    pool it started); its result, or its exception raised here."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["result"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised on the caller's thread
            out["error"] = e

    t = threading.Thread(target=body, name=f"own-{getattr(fn, '__name__', 'fn')}")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["result"]

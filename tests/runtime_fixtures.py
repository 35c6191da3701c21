"""One SmolLM2 per precision for the whole test run (the `smollm_int4` / `smollm_bf16`
fixtures in conftest.py use it). Tests must not modify these models (load their own instead)."""

from __future__ import annotations

import functools
from typing import Any

from model_runtime.loader import LoadedModel, load


@functools.cache
def cached_model(precision: str) -> LoadedModel:
    return load(precision=precision)


def serving_runtime(loaded: LoadedModel, *, max_batch: int = 4, max_queue: int = 8, **kw: Any):
    """A started gRPC runtime (`Runtime(**kw)`, e.g. faults, replica_id, telemetry) serving
    `loaded` through its own started Engine. The caller shuts it down."""
    from model_runtime.engine import Engine
    from model_runtime.service import Runtime

    engine = Engine(loaded, max_batch=max_batch, max_queue=max_queue)
    engine.start()
    rt = Runtime(**kw).start()
    rt.set_model(loaded, engine)
    return rt

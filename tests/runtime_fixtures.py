"""One SmolLM2 per precision for the whole test run (the `smollm_int4` / `smollm_bf16`
fixtures in conftest.py use it). Tests must not modify these models (load their own instead)."""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from model_runtime.loading.loader import LoadedModel, load


@functools.cache
def cached_model(precision: str) -> LoadedModel:
    return load(precision=precision)


def serving_runtime(loaded: LoadedModel, *, max_batch: int = 4, max_queue: int = 8, **kw: Any):
    """A started gRPC runtime (`Runtime(**kw)`, e.g. faults, replica_id, telemetry) serving
    `loaded` through its own started Engine. The caller shuts it down."""
    from model_runtime.engine.engine import Engine
    from model_runtime.serving.service import Runtime

    engine = Engine(loaded, max_batch=max_batch, max_queue=max_queue)
    engine.start()
    rt = Runtime(**kw).start()
    rt.set_model(loaded, engine)
    return rt


@contextlib.contextmanager
def serving_records(loaded: LoadedModel):
    """(records URL base, Client, Runtime): a serving runtime with its metrics port's /records."""
    from model_runtime.serving.client import Client
    from model_runtime.serving.telemetry import MetricsServer

    rt = serving_runtime(loaded)
    try:
        with MetricsServer(rt.telemetry, records=rt.records) as m, Client(rt.target) as c:
            yield f"http://127.0.0.1:{m.port}", c, rt
    finally:
        rt.shutdown(grace=5)


def get_json(url: str) -> tuple[int, Any]:
    """(HTTP status, JSON body), errors included."""
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextlib.contextmanager
def calls_in_background(target: str, calls: Sequence[Callable[[Any], object]], join_s: float = 60):
    """Each of `calls(client)` in turn, round and round, on one Client through a sidecar
    (authority llm) until the block ends; an RPC error is left for the gates to count."""
    import grpc

    from model_runtime.serving.client import Client

    stop = threading.Event()

    def run() -> None:
        with Client(target, authority="llm") as c:
            while not stop.is_set():
                for call in calls:
                    with contextlib.suppress(grpc.RpcError):
                        call(c)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=join_s)

"""/score runs its forward on the engine's thread (issue 18): scoring during a live generation
never runs a second forward on the model beside a decode step, returns the logprobs it returns
alone, and leaves the generation's tokens as they are alone. A real runtime, real gRPC; the
model is wrapped only to count forwards that begin while another one runs."""

from __future__ import annotations

import dataclasses
import json
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from model_runtime.serving.client import Client
from model_runtime.serving.service import Runtime
from model_runtime.serving.telemetry import MetricsServer
from tests.runtime_fixtures import serving_runtime

LONG = [{"role": "user", "content": "Write a long story about a dragon who learns to sing."}]
SHORT = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]


class Overlaps:
    """The real model; `overlaps` counts forwards begun while another forward was running."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.overlaps = self.forwards = self._active = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        with self._lock:
            self._active += 1
            self.forwards += 1
            self.overlaps += self._active > 1
        try:
            return self.model(*args, **kw)
        finally:
            with self._lock:
                self._active -= 1


@pytest.fixture(scope="module")
def served(smollm_int4) -> Iterator[tuple[str, Client, Overlaps, Runtime]]:
    probe = Overlaps(smollm_int4.model)
    rt = serving_runtime(dataclasses.replace(smollm_int4, model=probe))
    try:
        with MetricsServer(rt.telemetry, records=rt.records) as m, Client(rt.target) as c:
            yield f"http://127.0.0.1:{m.port}", c, probe, rt
    finally:
        rt.shutdown(grace=5)


def _score(url: str, rid: str, ids: list[int]) -> dict:
    q = f"{url}/score?request_id={rid}&token_ids={','.join(map(str, ids))}"
    with urllib.request.urlopen(q, timeout=60) as r:
        return json.loads(r.read())


def test_a_score_during_live_generation_runs_between_steps_and_changes_nothing(served) -> None:
    url, c, probe, _ = served
    answer = [t for ch in c.generate(messages=SHORT, max_new_tokens=6, request_id="short")
              for t in ch.token_ids]  # fmt: skip
    alone = _score(url, "short", answer)
    assert alone["argmax"] == answer

    def story(rid: str) -> list[int]:
        return [t for ch in c.generate(messages=LONG, max_new_tokens=48, request_id=rid)
                for t in ch.token_ids]  # fmt: skip

    story("warm")  # the prompt's blocks in the prefix cache, as for the two runs compared
    reference = story("reference")
    probe.overlaps = 0

    live: list[int] = []
    started, done = threading.Event(), threading.Event()

    def generate() -> None:
        for ch in c.generate(messages=LONG, max_new_tokens=48, request_id="live"):
            live.extend(ch.token_ids)
            started.set()
        done.set()

    t = threading.Thread(target=generate)
    t.start()
    assert started.wait(60)
    during = []
    while not done.is_set() and len(during) < 5:
        during.append((len(live), _score(url, "short", answer)))
    t.join(60)

    assert probe.overlaps == 0  # every scoring forward ran between two engine steps
    assert any(0 < n < 48 for n, _ in during), "no score ran while the story was generating"
    for _, got in during:
        assert got["argmax"] == alone["argmax"]
        assert got["logprobs"] == pytest.approx(alone["logprobs"], abs=1e-4)
    assert live == reference  # the generation's tokens are those it makes alone


def test_engine_run_returns_raises_and_refuses_once_stopped(smollm_int4) -> None:
    from model_runtime.engine.engine import Engine

    engine = Engine(smollm_int4, max_batch=1, kv_blocks=8)
    assert engine.run(lambda: threading.current_thread().name) != "meshlm-engine"  # inline
    engine.start()
    assert engine.run(lambda: threading.current_thread().name) == "meshlm-engine"
    with pytest.raises(ZeroDivisionError):
        engine.run(lambda: 1 / 0)
    assert engine.run(lambda: 42) == 42  # a failing task leaves the engine serving
    engine.shutdown(drain_timeout=1)
    with pytest.raises(RuntimeError, match="stopped"):
        engine.run(lambda: 42)

"""The non-finite guard on a real overflow: a weight group whose int4 scale overflows.

Layer 3's q/k/v weights get +3e38 and -3e38 in two input columns whose RMSNorm gain is zero.
The dense layer is unchanged in effect (those inputs are exactly 0), but re-quantizing the group
needs a scale of (max - min) / 15 = inf, so the int4 kernel returns NaN. The guard must notice,
recompute that layer densely, count it, and the answer must stay right.
"""

from __future__ import annotations

import copy

import pytest
import torch

from model_runtime import generate
from model_runtime.engine import Engine, GenerateParams
from model_runtime.quant import Int4Linear
from tests.runtime_fixtures import cached_model

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]


@pytest.fixture(scope="module")
def poisoned():
    lm = copy.deepcopy(cached_model("int4"))  # a private copy: the shared one stays intact
    layer = lm.model.layers[3]
    w = layer.attention.wqkv.dequantize().float()
    w[:, 64], w[:, 65] = 3e38, -3e38
    layer.attention_norm.data[64:66] = 0
    layer.attention.wqkv = Int4Linear.from_dense(w, 32, keep_dense=True)
    assert not torch.isfinite(layer.attention.wqkv.dequantize()).all()  # the int4 copy is broken
    return lm


def test_guard_falls_back_and_counts(poisoned):
    ids = poisoned.tokenizer.encode_chat(QUESTION)
    before = poisoned.guard.fallbacks
    out = generate.greedy(poisoned, [ids], 12)[0]
    assert poisoned.tokenizer.decode(out) == "The capital of France is Paris."
    assert poisoned.guard.fallbacks - before >= len(out)  # every forward hit layer 3
    assert poisoned.guard.unrecovered == 0


def test_without_guard_the_overflow_is_real(poisoned):
    guard, poisoned.model.guard = poisoned.model.guard, None
    try:
        ids = torch.tensor([poisoned.tokenizer.encode_chat(QUESTION)])
        with torch.inference_mode():
            assert torch.isnan(poisoned.model(ids)).all()
    finally:
        poisoned.model.guard = guard


def test_engine_reports_fallbacks(poisoned):
    e = Engine(poisoned, max_batch=2)
    e.start()
    events = []
    try:
        e.submit("q", GenerateParams(poisoned.tokenizer.encode_chat(QUESTION), 12), events.append)
        e.shutdown(drain_timeout=120)
    finally:
        e.shutdown(drain_timeout=0)
    assert events[-1].finish_reason == "stop"
    assert "".join(ev.text_delta for ev in events) == "The capital of France is Paris."
    assert e.stats()["nonfinite_fallbacks"] > 0

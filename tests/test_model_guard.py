"""The non-finite guard on a real overflow: a weight group whose int4 scale overflows.

Layer 3's q/k/v weights get +3e38 and -3e38 in two input columns whose RMSNorm gain is zero.
The dense layer is unchanged in effect (those inputs are exactly 0), but re-quantizing the group
needs a scale of (max - min) / 15 = inf, so the int4 kernel returns NaN. The guard must notice,
recompute that layer densely, count it, and the answer must stay right. And what sets the guard
off: a float32 sum of a layer's output, so that finite fp16 states whose fp16 sum overflows do not.
"""

from __future__ import annotations

import copy

import pytest
import torch

from model_runtime.engine import generate
from model_runtime.engine.engine import Engine, GenerateParams
from model_runtime.engine.perplexity import stdlib_text
from model_runtime.llm.model import all_finite
from model_runtime.llm.quant import Int4Linear
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


def test_finite_fp16_states_whose_fp16_sum_overflows_read_as_finite():
    h = torch.full((512, 576), 1000.0, dtype=torch.float16)
    assert not torch.isfinite(h.sum())  # an fp16 sum of finite values: inf
    assert all_finite(h)
    for bad in (float("inf"), float("nan")):
        h[7, 3] = bad
        assert not all_finite(h)


def test_an_fp16_prefill_runs_its_layers_once():
    """SmolLM2's hidden states reach ~24k: their fp16 sum overflows on any prompt past a few
    tokens, and a guard that read that as non-finite ran every fp16 prefill a second time
    (CUDA's fp16 path; fp16 on the CPU here, built directly: load() keeps it for CUDA)."""
    from model_runtime.loading.gguf_loader import default_gguf_path, read_gguf
    from model_runtime.loading.loader import build_model

    g = read_gguf(default_gguf_path())
    model = build_model(g.args, g.tensors, "bf16", dtype=torch.float16)
    checked = []
    model.guard = lambda i, block, h_in, out, redo: checked.append(i) or out
    text = cached_model("int4").tokenizer.encode(stdlib_text())
    prompt = text[600:728]  # 128 tokens: their fp16 sum is inf, their float32 sum ~2e5
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]))
    assert torch.isfinite(logits).all()
    assert checked == []  # no second, layer-by-layer pass

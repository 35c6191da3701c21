"""Decode steps replayed from CUDA graphs (model_runtime/llm/cuda_graphs.py).

On the CPU the padded static step runs eagerly (`GraphStep.step_eager`): the same inputs, padding
and mask that a captured graph reads, so these tests check that a padded batch and padded keys
give the unpadded step's logits and touch no cache slot but the step's own. The capture and
replay themselves need a CUDA device: that test is skipped, saying so, where torch sees none
(CI); it ran on a lent H200 (BENCHMARKS.md, GPU path)."""

from __future__ import annotations

import pytest
import torch

from model_runtime.engine import generate
from model_runtime.engine.kvcache import layout_decode, layout_prefill
from model_runtime.llm import cuda_graphs

STORY = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
BS = generate.BLOCK


def _teacher_forced(lm, prompts: list[list[int]], forced: list[int], step) -> tuple:
    """Prefill each prompt, then feed every row the same `forced` tokens one decode step at a
    time through `step(tokens, cache, layout)` (None: the model's own torch ops). Returns each
    step's logits [B, V] and the cache."""
    model = lm.model
    saved = model.native_step, model.native_attention
    model.native_step = step
    model.native_attention = None  # SDPA both ways
    try:
        kv, seqs = generate.paged_cache(model, len(prompts), max(map(len, prompts)) + len(forced))
        for s, p in zip(seqs, prompts, strict=True):
            lay = layout_prefill(s, 0, len(p), BS).to(model.device)
            model(torch.tensor([p], device=model.device), kv, lay)
            s.written = len(p)
        out = []
        for t in forced:
            tokens = torch.tensor([[t]] * len(prompts), device=model.device)
            out.append(model(tokens, kv, layout_decode(seqs, BS).to(model.device)))
            for s in seqs:
                s.written += 1
        return out, kv, seqs
    finally:
        model.native_step, model.native_attention = saved


def test_buckets_pad_the_batch_and_the_keys():
    assert cuda_graphs.bucket(1, 16) == (1, cuda_graphs.KEYS)
    assert cuda_graphs.bucket(3, 17) == (4, cuda_graphs.KEYS)
    assert cuda_graphs.bucket(9, cuda_graphs.KEYS + 1) == (16, 2 * cuda_graphs.KEYS)
    assert cuda_graphs.bucket(cuda_graphs.BATCHES[-1] + 1, 16) is None


def test_graphs_apply_only_on_a_cuda_device(smollm_bf16, monkeypatch):
    assert "not a CUDA device" in cuda_graphs.why_not(smollm_bf16.model)
    monkeypatch.setenv("MESHLM_CUDA_GRAPHS", "0")
    assert cuda_graphs.why_not(smollm_bf16.model) == "MESHLM_CUDA_GRAPHS=0"


def test_the_padded_static_step_gives_the_steps_logits_and_writes_only_its_slots(smollm_bf16):
    lm = smollm_bf16
    tok = lm.tokenizer
    prompts = [tok.encode_chat(STORY), tok.encode("The knight"), tok.encode("Once upon a time")]
    forced = tok.encode(" there was a dragon who lived in a cave")
    step = cuda_graphs.GraphStep(lm.model).step_eager
    ref, ref_kv, seqs = _teacher_forced(lm, prompts, forced, None)
    got, kv, _ = _teacher_forced(lm, prompts, forced, step)
    for a, b in zip(ref, got, strict=True):
        # 3 rows padded to 4, keys to 256 (masked): the same sums in bf16, maybe in another
        # order, so within a few bf16 steps of the largest logit, never a wrong row or mask
        assert a.shape == b.shape
        assert (a - b).abs().max() <= 0.01 * a.abs().max()
    used = torch.zeros(kv.kv.shape[1], dtype=torch.bool)
    for s in seqs:
        used[[s.blocks[i // BS] * BS + i % BS for i in range(s.written)]] = True
    assert torch.count_nonzero(kv.kv[:, ~used]) == 0  # the padded row wrote no other slot
    assert torch.count_nonzero(ref_kv.kv[:, ~used]) == 0
    assert torch.allclose(kv.kv[:, used].float(), ref_kv.kv[:, used].float(), atol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replayed_graphs_decode_like_eager_steps_on_a_cuda_device():
    from model_runtime.loading.loader import load

    lm = load(precision="fp16", device="cuda")
    tok = lm.tokenizer
    prompts = [tok.encode_chat(STORY), tok.encode("The knight"), tok.encode("Once upon a time")]
    forced = tok.encode(" there was a dragon who lived in a cave")
    graphs = cuda_graphs.GraphStep(lm.model)
    ref, _, _ = _teacher_forced(lm, prompts, forced, None)
    got, _, _ = _teacher_forced(lm, prompts, forced, graphs)
    assert graphs.captures >= 1
    for a, b in zip(ref, got, strict=True):
        assert (a - b).abs().max() <= 0.01 * a.abs().max()
    france = tok.encode_chat(
        [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
    )
    cuda_graphs.use(lm.model, True)
    assert isinstance(lm.model.native_step, cuda_graphs.GraphStep)
    assert tok.decode(generate.greedy(lm, [france], 16)[0]) == "The capital of France is Paris."

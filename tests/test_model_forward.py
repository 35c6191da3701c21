"""Attention over the paged KV cache on a tiny random model: where each row's slots form a run
(rows a fixed stride apart) it reads the cache as a strided view instead of gathering it per
layer, with the same logits as the gather and as an uncached forward."""

from __future__ import annotations

import pytest
import torch

from model_runtime.engine.kvcache import SeqCache, layout_decode, layout_prefill
from model_runtime.llm.model import KVCache, ModelArgs, Transformer

ARGS = ModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=40, context_length=96
)
BS = 4  # block size


@pytest.fixture(scope="module")
def model() -> Transformer:
    gen = torch.Generator().manual_seed(0)
    m = Transformer(ARGS)
    for p in m.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1 if p.dim() == 1 else 0))
    return m.eval()


def _decode(model, blocks: list[list[int]], prompts: list[list[int]], steps: int, n_slots: int):
    """Prefill each prompt, then decode `steps` tokens as one batch; logits of every step."""
    kv = KVCache(ARGS, n_slots, torch.float32)
    seqs = [SeqCache(b) for b in blocks]
    nxt, out, runs = [], [], []
    with torch.inference_mode():
        for s, p in zip(seqs, prompts, strict=True):
            lay = layout_prefill(s, 0, len(p), BS)
            runs.append(lay.kv_run)
            nxt.append(int(model(torch.tensor([p]), kv, lay)[0].argmax()))
            s.written = len(p)
        for _ in range(steps):
            lay = layout_decode(seqs, BS)
            runs.append(lay.kv_run)
            logits = model(torch.tensor([[t] for t in nxt]), kv, lay)
            out.append(logits)
            nxt = logits.argmax(-1).tolist()
            for s in seqs:
                s.written += 1
    return out, runs


PROMPTS = [[3, 5, 7, 9, 11, 2, 4], [6, 8, 10], [12, 14, 16, 18, 20]]


def test_a_run_of_slots_is_read_as_a_view_with_the_gathers_result(model):
    # blocks 0-3, 4-7, 8-11: every row's slots are a run, rows a fixed stride apart
    runs_blocks = [list(range(i * 4, i * 4 + 4)) for i in range(3)]
    # the same rows with their blocks shuffled over the pool: gathered
    scattered = [[11, 2, 7, 0], [5, 9, 1, 10], [3, 8, 6, 4]]
    viewed, runs = _decode(model, runs_blocks, PROMPTS, 6, 48)
    assert runs[0] == (0, 0) and runs[3:] == [(0, 16)] * 6
    gathered, runs = _decode(model, scattered, PROMPTS, 6, 48)
    assert all(r is None for r in runs[3:])
    for a, b in zip(viewed, gathered, strict=True):
        assert torch.equal(a, b)


def _assert_uncached(model, prompts, logits):
    with torch.inference_mode():  # the prefill's token first
        seqs = [[*p, int(model(torch.tensor([p]))[0].argmax())] for p in prompts]
    for step in logits:
        for i, row in enumerate(step):
            with torch.inference_mode():
                want = model(torch.tensor([seqs[i]]), all_logits=True)[0, -1]
            torch.testing.assert_close(row, want, atol=1e-4, rtol=1e-4)
            seqs[i].append(int(row.argmax()))


def test_paged_decode_matches_the_uncached_forward(model):
    # rows of unequal length (the shorter ones padded and masked) read through the view
    logits, runs = _decode(model, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], PROMPTS, 5, 48)
    assert runs[3] == (0, 16)
    _assert_uncached(model, PROMPTS, logits)


def test_a_view_past_the_pools_end_falls_back_to_the_gather(model):
    # row 1 starts at slot 16 of a 24-slot pool; the batch attends up to 15 slots: 16 + 15 > 24
    prompts = [list(range(2, 14)), [6, 8, 10]]
    logits, runs = _decode(model, [[0, 1, 2, 3], [4, 5]], prompts, 3, 24)
    assert runs[2:] == [(0, 16)] * 3
    _assert_uncached(model, prompts, logits)

"""A plain batched decode loop over the paged cache, without the scheduler (tests, benchmark)."""

from __future__ import annotations

import time

import torch

from model_runtime.engine.kvcache import SeqCache, layout_decode, layout_prefill
from model_runtime.engine.sampling import greedy_ids
from model_runtime.llm.model import KVCache

BLOCK = 16  # slots a cache block


def paged_cache(model, n_seqs: int, max_len: int) -> tuple[KVCache, list[SeqCache]]:
    """A cache of `n_seqs` sequences of up to `max_len` tokens, each its own run of blocks."""
    per_seq = -(-max_len // BLOCK)
    kv = KVCache(model.args, per_seq * BLOCK * n_seqs, model.dtype, model.device)
    return kv, [SeqCache(list(range(i * per_seq, (i + 1) * per_seq))) for i in range(n_seqs)]


@torch.inference_mode()
def greedy(
    loaded,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop: bool = True,
    step_times: list[float] | None = None,
):
    """Greedy continuation of each prompt (prefilled one by one, decoded as one batch).
    Returns the generated ids per prompt (without the stop token); appends the wall time of
    every decode step to `step_times` when given."""
    model, bs = loaded.model, BLOCK
    dev = model.device
    kv, seqs = paged_cache(model, len(prompts), max(map(len, prompts)) + max_new_tokens)
    nxt = []
    for s, p in zip(seqs, prompts, strict=True):
        logits = model(torch.tensor([p], device=dev), kv, layout_prefill(s, 0, len(p), bs).to(dev))
        s.written = len(p)
        nxt += greedy_ids(logits)
    out: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    stop_ids = loaded.tokenizer.stop_ids if stop else set()
    for step in range(max_new_tokens):
        live = [i for i in live if nxt[i] not in stop_ids]
        for i in live:
            out[i].append(nxt[i])
        if not live or step == max_new_tokens - 1:
            break
        t0 = time.perf_counter()
        logits = model(
            torch.tensor([[nxt[i]] for i in live], device=dev),
            kv,
            layout_decode([seqs[i] for i in live], bs).to(dev),
        )
        for j, tok in enumerate(greedy_ids(logits)):
            seqs[live[j]].written += 1
            nxt[live[j]] = tok
        if step_times is not None:
            step_times.append(time.perf_counter() - t0)
    return out

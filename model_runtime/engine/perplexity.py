"""Perplexity of a model over consecutive windows of a text (the check for quantization)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F


def stdlib_text() -> str:
    """`pydoc_data/topics.py` from the running Python's stdlib: the same text on every machine
    with the same Python version (each release rewrites it: SmolLM2's int4 perplexity over 6x512
    tokens is 10.329 with 3.11.7's, 10.292 with 3.12.1's), so compare figures of one Python."""
    import pydoc_data

    return (Path(pydoc_data.__file__).parent / "topics.py").read_text()


@torch.inference_mode()
def perplexity(model, token_ids: list[int], window: int, n_windows: int) -> float:
    need = window * n_windows
    if len(token_ids) < need:
        raise ValueError(f"need {need} tokens, text has {len(token_ids)}")
    x = torch.tensor(token_ids[:need], device=model.device).view(n_windows, window)
    nll, count = 0.0, 0
    for row in x:  # one window at a time keeps peak memory at one [window, vocab] logits
        logits = model(row.view(1, -1), all_logits=True)[0, :-1]
        nll += F.cross_entropy(logits, row[1:], reduction="sum").item()
        count += window - 1
    return math.exp(nll / count)


@torch.inference_mode()
def decode_perplexity(model, token_ids: list[int], window: int, n_windows: int) -> float:
    """Perplexity as served: each window's tokens fed one at a time through decode steps (the
    windows as one batch), so that a decode-only path counts (the native step, int8
    activations: kernels/q8.c), which `perplexity`'s one forward a window never runs."""
    from model_runtime.engine.generate import BLOCK as bs
    from model_runtime.engine.generate import paged_cache
    from model_runtime.engine.kvcache import layout_decode, layout_prefill

    need = window * n_windows
    if len(token_ids) < need:
        raise ValueError(f"need {need} tokens, text has {len(token_ids)}")
    x = torch.tensor(token_ids[:need], device=model.device).view(n_windows, window)
    kv, seqs = paged_cache(model, n_windows, window)
    first = []
    for s, row in zip(seqs, x, strict=True):  # the first token of each window
        first.append(
            model(row[:1].view(1, 1), kv, layout_prefill(s, 0, 1, bs).to(x.device))[0].float()
        )
        s.written = 1
    nll = F.cross_entropy(torch.stack(first), x[:, 1], reduction="sum").item()
    for t in range(1, window - 1):  # one [n_windows, vocab] logits at a time
        out = model(x[:, t : t + 1], kv, layout_decode(seqs, bs).to(x.device)).float()
        for s in seqs:
            s.written += 1
        nll += F.cross_entropy(out.reshape(n_windows, -1), x[:, t + 1], reduction="sum").item()
    return math.exp(nll / (n_windows * (window - 1)))

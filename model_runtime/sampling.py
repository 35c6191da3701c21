"""Next-token choice: greedy, or temperature / top-k / top-p with a per-request generator."""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> int:
    """logits float32 [V] -> token id."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = cum - sorted_p > top_p  # keep the smallest set whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))

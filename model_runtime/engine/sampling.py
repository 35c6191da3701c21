"""Next-token choice: greedy, or temperature / top-k / top-p with a per-request generator."""

from __future__ import annotations

import hashlib

import torch


def generator_at(gen: torch.Generator, seed: int, position: int) -> torch.Generator:
    """Reseed `gen` for the token at `position` (0-based) of a stream seeded with `seed`.

    Each token draws from its own derived seed rather than from one running generator, so a
    stream resumed after k tokens on another replica samples token k exactly as the
    uninterrupted stream did, however many numbers the sampler consumed before.
    """
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return gen.manual_seed(int.from_bytes(digest, "little"))


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """The argmax of every row of logits [B, V]: the first of equal maxima, a NaN before any
    number, as torch's argmax. On the CPU numpy's, which reduces a decode step's logits several
    times faster than torch's argmax does."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> int:
    """logits float32 [V] -> token id."""
    if temperature <= 0:
        return greedy_ids(logits.reshape(1, -1))[0]
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

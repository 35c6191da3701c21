"""Perplexity of a model over consecutive windows of a text (the check for quantization)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F


def stdlib_text() -> str:
    """`pydoc_data/topics.py` from the running Python's stdlib: the same text on every machine."""
    import pydoc_data

    return (Path(pydoc_data.__file__).parent / "topics.py").read_text()


@torch.inference_mode()
def perplexity(model, token_ids: list[int], window: int, n_windows: int) -> float:
    need = window * n_windows
    if len(token_ids) < need:
        raise ValueError(f"need {need} tokens, text has {len(token_ids)}")
    x = torch.tensor(token_ids[:need]).view(n_windows, window)
    nll, count = 0.0, 0
    for row in x:  # one window at a time keeps peak memory at one [window, vocab] logits
        logits = model(row.view(1, -1), all_logits=True)[0, :-1]
        nll += F.cross_entropy(logits, row[1:], reduction="sum").item()
        count += window - 1
    return math.exp(nll / count)

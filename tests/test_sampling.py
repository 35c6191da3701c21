"""Greedy choice (sampling.greedy_ids): numpy's argmax on the CPU must choose exactly what
torch's argmax chooses, ties and non-finite logits included, or greedy output would change."""

from __future__ import annotations

import torch

from model_runtime.engine.sampling import greedy_ids, sample


def test_greedy_ids_choose_what_torch_argmax_chooses():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 49152, generator=g)
    x[1, 100] = x[1, 200] = x[1].max() + 1  # a tie: the first
    x[2, 5], x[2, 9] = float("nan"), float("nan")  # NaN wins, the first one
    x[3] = float("-inf")
    x[4, 40000] = float("inf")
    x[5] = x[5].bfloat16().float()  # many equal values near the top
    for rows in (x, x[:, ::2], x.bfloat16(), x[6:7]):  # contiguous or not, bf16, one row
        assert greedy_ids(rows) == rows.argmax(-1).tolist()
    assert greedy_ids(x)[1:5] == [100, 5, 0, 40000]


def test_temperature_zero_samples_the_greedy_choice():
    x = torch.randn(49152, generator=torch.Generator().manual_seed(3))
    assert sample(x, 0.0, 0, 1.0, None) == int(x.argmax())
    assert sample(x[::2], 0.0, 0, 1.0, None) == int(x[::2].argmax())

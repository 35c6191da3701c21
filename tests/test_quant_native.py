"""The native int4 kernel (model_runtime/kernels) against torch's int4pack kernel on real Q4_1
layers of SmolLM2: the same bits, whatever the rows, the batch position or the threads."""

from __future__ import annotations

import pytest
import torch

from model_runtime import kernels
from model_runtime.gguf_loader import Q4_1, default_gguf_path, read_gguf
from model_runtime.quant import Int4Linear, Int8Linear

# one of each shape the model has: qkv [960, 576], wo [576, 576], gate|up [1536, 576] halves,
# down [576, 1536]
NAMES = ("blk.0.attn_q.weight", "blk.7.attn_output.weight", "blk.29.ffn_up.weight")
NAMES += ("blk.13.ffn_down.weight",)


@pytest.fixture(scope="module")
def gguf():
    return read_gguf(default_gguf_path())


@pytest.fixture(scope="module")
def q4_layers(gguf):
    return [gguf.tensors[n] for n in NAMES]


def _pair(q, monkeypatch):
    native = Int4Linear.from_q4_1(q)
    with monkeypatch.context() as m:
        m.setenv("MESHLM_INT4_KERNEL", "torch")
        reference = Int4Linear.from_q4_1(q)
    assert not reference.native
    return native, reference


@torch.inference_mode()
def test_native_kernel_is_bit_identical_to_torchs(q4_layers, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    for q in q4_layers:
        native, reference = _pair(q, monkeypatch)
        assert native.native == kernels.applies(), kernels.why_not()
        for rows in (1, 3, 8, 13):
            x = (torch.randn(rows, q.codes.shape[1], generator=gen) * 2).to(torch.bfloat16)
            y = native(x)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, q.codes.shape[0])
            assert torch.equal(y, reference(x)), (q.codes.shape, rows)


def _cancelling_layer(n: int = 128, k: int = 256) -> Q4_1:
    """Weights whose second half negates the first (codes 16 - q, zeros negated): with the same
    activations in both halves every output is what fp32 rounding left of a sum that cancels,
    so any other order or rounding of the products shows in the bf16 result (on real weights
    the final bf16 rounding hides nearly all of it)."""
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(1, 16, (n, k // 2), generator=gen)
    d = (torch.rand(n, k // 64, generator=gen) * 0.1 + 0.01).to(torch.bfloat16).float()
    z = (torch.rand(n, k // 64, generator=gen) - 0.5).to(torch.bfloat16).float()
    return Q4_1(
        torch.cat([codes, 16 - codes], 1),
        torch.cat([d, d], 1),
        torch.cat([z - 8 * d, -z - 8 * d], 1),
    )


@torch.inference_mode()
def test_native_kernel_rounds_every_product_as_torchs_does(monkeypatch):
    q = _cancelling_layer()
    native, reference = _pair(q, monkeypatch)
    half = (torch.randn(8, 128, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    x = torch.cat([half, half], 1)
    want = reference(x)
    assert want.abs().max() < 0.01 and bool((want != 0).any())  # residues of rounding only
    assert torch.equal(native(x), want)


@torch.inference_mode()
def test_a_row_comes_out_the_same_alone_batched_and_on_any_thread_count(q4_layers, monkeypatch):
    native, _ = _pair(q4_layers[3], monkeypatch)
    x = torch.randn(11, native.in_features, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([native(x[i : i + 1]) for i in range(11)])
        torch.set_num_threads(2)
        batched = native(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, batched)


def test_dequantize_gives_the_weights_of_the_file(q4_layers, monkeypatch):
    q = q4_layers[1]
    native, reference = _pair(q, monkeypatch)
    assert torch.equal(native.dequantize(), reference.dequantize())
    want = q.dequantize().to(torch.bfloat16)
    assert (native.dequantize().float() - want.float()).abs().max() < 1e-2


def test_the_native_kernel_takes_bf16_activations_only(q4_layers):
    lin = Int4Linear.from_q4_1(q4_layers[0])
    if not lin.native:
        assert kernels.why_not()  # the reason is said, torch's kernel serves instead
        return
    with pytest.raises(TypeError, match=r"bf16 activations, got torch\.float32"):
        lin(torch.zeros(1, lin.in_features))


@pytest.fixture(scope="module")
def head(gguf):
    return Int8Linear.from_dense(gguf.tensors["token_embd.weight"])


@torch.inference_mode()
def test_native_int8_head_is_bit_identical_to_torchs(head):
    assert head.native == kernels.applies(), kernels.why_not()
    gen = torch.Generator().manual_seed(4)
    for rows in (1, 3, 8, 9):
        x = (torch.randn(rows, head.in_features, generator=gen) * 2).to(torch.bfloat16)
        want = torch.ops.aten._weight_int8pack_mm(x, head.q, head.scales)
        assert torch.equal(head(x), want), rows
    # a sum that cancels: what is left is fp32 rounding, so any other order of it shows
    half = (torch.randn(2, head.in_features // 2, generator=gen) * 4).to(torch.bfloat16)
    x = torch.cat([half, -half], 1)
    q = head.q.clone()
    q[:, head.in_features // 2 :] = q[:, : head.in_features // 2]
    cancelling = Int8Linear(q, head.scales)
    want = torch.ops.aten._weight_int8pack_mm(x, q, head.scales)
    assert bool((want != 0).any()) and want.abs().max() < 0.05 * head(x).abs().max()
    assert torch.equal(cancelling(x), want)

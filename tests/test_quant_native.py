"""The native int4 and int8 kernels (model_runtime/kernels) on real layers of SmolLM2, for each
build this CPU runs (AVX-512, AVX2: MESHLM_KERNEL_ISA): within one bf16 rounding of torch's int4pack
and int8pack kernels, their products added in the order qmm.c documents (a layer whose sum cancels
shows any other order), the same bits with the bf16 dot-product instruction as with FMAs, and
whatever the rows, the batch position or the threads."""

from __future__ import annotations

import pytest
import torch

from model_runtime.kernels import isas, qmm
from model_runtime.llm.quant import Q4_1, Int4Linear, Int8Linear
from model_runtime.loading.gguf_loader import default_gguf_path, read_gguf

# one of each shape the model has: qkv [960, 576], wo [576, 576], gate|up [1536, 576] halves,
# down [576, 1536]
NAMES = ("blk.0.attn_q.weight", "blk.7.attn_output.weight", "blk.29.ffn_up.weight")
NAMES += ("blk.13.ffn_down.weight",)


@pytest.fixture(params=isas.BUILDS)
def build(request, monkeypatch):
    """Each build of the native kernels in turn, forced by MESHLM_KERNEL_ISA; skipped where the
    CPU does not run it."""
    if not isas.runs(request.param):
        pytest.skip(f"this CPU does not run the {request.param} build")
    monkeypatch.setenv(isas.ISA_ENV, request.param)
    assert isas.isa() == request.param
    return request.param


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
    assert native.isa == (isas.isa() if qmm.applies() else None)
    return native, reference


def assert_within_bf16_rounding(ours: torch.Tensor, want: torch.Tensor) -> None:
    """Each output within one bf16 rounding of torch's (the two add the fp32 products in other
    orders: sums a few ulps apart, so an output near 0, where terms cancel, may differ by more
    than its own bf16 step, never by more than a 1e-4 part of the largest), and most the same."""
    atol = 1e-4 * float(want.float().abs().max())
    torch.testing.assert_close(ours.float(), want.float(), rtol=2.0**-7, atol=atol)
    assert float((ours != want).float().mean()) < 0.05


@torch.inference_mode()
def test_native_kernel_is_within_one_bf16_rounding_of_torchs(q4_layers, build, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    for q in q4_layers:
        native, reference = _pair(q, monkeypatch)
        assert native.native == qmm.applies(), qmm.why_not()
        for rows in (1, 3, 8, 13):
            x = (torch.randn(rows, q.codes.shape[1], generator=gen) * 2).to(torch.bfloat16)
            y = native(x)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, q.codes.shape[0])
            assert_within_bf16_rounding(y, reference(x))


def _cancelling_layer(n: int = 128, k: int = 256, unit: bool = False) -> Q4_1:
    """Weights whose second half negates the first (codes 16 - q, zeros negated): with the same
    activations in both halves every output is what fp32 rounding left of a sum that cancels,
    so any other order or rounding of the products shows in the bf16 result (on real weights
    the final bf16 rounding hides nearly all of it). unit: scales 1 and zeros 0 (w = q - 8)."""
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(1, 16, (n, k // 2), generator=gen)
    d = (torch.rand(n, k // 64, generator=gen) * 0.1 + 0.01).to(torch.bfloat16).float()
    z = (torch.rand(n, k // 64, generator=gen) - 0.5).to(torch.bfloat16).float()
    if unit:
        d, z = torch.ones_like(d), torch.zeros_like(z)
    return Q4_1(
        torch.cat([codes, 16 - codes], 1),
        torch.cat([d, d], 1),
        torch.cat([z - 8 * d, -z - 8 * d], 1),
    )


def _int4_in_order(x: torch.Tensor, q: Q4_1) -> torch.Tensor:
    """qmm.c's int4 arithmetic where scales are 1 and zeros 0 (w = q - 8; its two FMAs a group
    then add exactly): per output and group of 32 the exact products x_k (q_k - 8) added k + 1
    then k for each pair, the groups added in order, rounded to bf16."""
    xf, w = x.float(), q.codes.float() - 8
    acc = torch.zeros(x.shape[0], w.shape[0])
    for g in range(0, w.shape[1], 32):
        part = torch.zeros_like(acc)
        for k in range(g, g + 32, 2):
            part = part + xf[:, k + 1 : k + 2] * w[:, k + 1]
            part = part + xf[:, k : k + 1] * w[:, k]
        acc = acc + part
    return acc.to(torch.bfloat16)


@torch.inference_mode()
def test_native_kernel_adds_the_products_in_its_documented_order(build, monkeypatch):
    q = _cancelling_layer(unit=True)
    native, _ = _pair(q, monkeypatch)
    half = (torch.randn(8, 128, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    x = torch.cat([half, half], 1)
    want = _int4_in_order(x, q)
    assert want.abs().max() < 0.01 and bool((want != 0).any())  # residues of rounding only
    assert torch.equal(native(x), want)


@torch.inference_mode()
def test_the_dot_product_instruction_and_fmas_give_the_same_bits(q4_layers, head_weights):
    if not isas.has_bf16_dot("avx512"):
        pytest.skip("this CPU lacks avx512_bf16 (the AVX-512 build's dot product)")
    lib = qmm.library("avx512")
    layers = [Int4Linear.from_q4_1(q) for q in q4_layers] + [Int8Linear.from_dense(head_weights)]
    assert all(lin.isa == "avx512" for lin in layers)
    gen = torch.Generator().manual_seed(6)
    try:
        for lin in layers:
            for rows in (1, 3, 8, 13):
                x = (torch.randn(rows, lin.in_features, generator=gen) * 2).to(torch.bfloat16)
                qmm.set_dot(lib, "avx512", True)
                dot = lin(x)
                qmm.set_dot(lib, "avx512", False)
                assert torch.equal(lin(x), dot), (lin, rows)
    finally:
        qmm.set_dot(lib, "avx512")


@torch.inference_mode()
def test_a_row_comes_out_the_same_alone_batched_and_on_any_thread_count(
    q4_layers, build, monkeypatch
):
    native, _ = _pair(q4_layers[3], monkeypatch)
    alone, batched = _alone_and_batched(native, seed=1)
    assert torch.equal(alone, batched)


def _alone_and_batched(layer, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """11 rows through `layer` one at a time on 1 thread, then as one batch on 2."""
    x = torch.randn(11, layer.in_features, generator=torch.Generator().manual_seed(seed))
    x = x.to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(11)])
        torch.set_num_threads(2)
        return alone, layer(x)
    finally:
        torch.set_num_threads(threads)


def test_dequantize_gives_the_weights_of_the_file(q4_layers, build, monkeypatch):
    q = q4_layers[1]
    native, reference = _pair(q, monkeypatch)
    assert torch.equal(native.dequantize(), reference.dequantize())
    want = q.dequantize().to(torch.bfloat16)
    assert (native.dequantize().float() - want.float()).abs().max() < 1e-2


def test_the_native_kernel_takes_bf16_activations_only(q4_layers):
    lin = Int4Linear.from_q4_1(q4_layers[0])
    if not lin.native:
        assert qmm.why_not()  # the reason is said, torch's kernel serves instead
        return
    with pytest.raises(TypeError, match=r"bf16 activations, got torch\.float32"):
        lin(torch.zeros(1, lin.in_features))


@pytest.fixture(scope="module")
def head_weights(gguf):
    return gguf.tensors["token_embd.weight"]


def _int8_in_order(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """qmm.c's int8 arithmetic: per output 16 lanes, lane l adding the exact products x q of
    k0 + 2l + 1 then k0 + 2l for each chunk of 32 from k0, the even and the odd chunks apart, then
    the two added; the lanes summed as vf_sums16's tree; times the scale, rounded to bf16."""
    xf, w = x.float(), q.float()
    lanes = [torch.zeros(x.shape[0], w.shape[0], 16) for _ in range(2)]
    for i, k0 in enumerate(range(0, w.shape[1], 32)):
        for k in (k0 + 1, k0):
            lanes[i % 2] = lanes[i % 2] + xf[:, None, k : k0 + 32 : 2] * w[None, :, k : k0 + 32 : 2]
    v = lanes[0] + lanes[1]
    v = v[..., :8] + v[..., 8:]
    v = v[..., :4] + v[..., 4:]
    return (((v[..., 0] + v[..., 2]) + (v[..., 1] + v[..., 3])) * scales.float()).to(torch.bfloat16)


@torch.inference_mode()
def test_native_int8_head_is_as_torchs_and_adds_in_its_documented_order(head_weights, build):
    head = Int8Linear.from_dense(head_weights)
    assert head.native == qmm.applies(), qmm.why_not()
    assert head.isa == (build if qmm.applies() else None)
    gen = torch.Generator().manual_seed(4)
    for rows in (1, 3, 8, 9):
        x = (torch.randn(rows, head.in_features, generator=gen) * 2).to(torch.bfloat16)
        want = torch.ops.aten._weight_int8pack_mm(x, head.q, head.scales)
        assert_within_bf16_rounding(head(x), want)
    # a sum that cancels: what is left is fp32 rounding, so any other order of it shows
    half = (torch.randn(2, head.in_features // 2, generator=gen) * 4).to(torch.bfloat16)
    x = torch.cat([half, -half], 1)
    q = head.q.clone()
    q[:, head.in_features // 2 :] = q[:, : head.in_features // 2]
    cancelling = Int8Linear(q, head.scales)
    want = _int8_in_order(x, q, head.scales)
    assert bool((want != 0).any()) and want.abs().max() < 0.05 * head(x).abs().max()
    assert torch.equal(cancelling(x), want)


@torch.inference_mode()
def test_an_int8_layer_the_native_kernel_cannot_take_runs_on_torchs():
    """The native int8 kernel takes the inputs in chunks of 32: a layer of 48 inputs keeps
    torch's kernel (and its bits) rather than failing."""
    w = torch.randn(128, 48, generator=torch.Generator().manual_seed(7))
    head = Int8Linear.from_dense(w)
    assert not head.native and head.isa is None
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    assert torch.equal(head(x), torch.ops.aten._weight_int8pack_mm(x, head.q, head.scales))


@torch.inference_mode()
def test_a_head_row_comes_out_the_same_alone_batched_and_on_any_thread_count(head_weights, build):
    alone, batched = _alone_and_batched(Int8Linear.from_dense(head_weights), seed=5)
    assert torch.equal(alone, batched)

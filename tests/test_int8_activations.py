"""int8 activations for the int4 model (`meshlm serve --activations int8`, kernels/q8.c): int4
weights times activations quantized to int8 per group of 32, as llama.cpp's Q4 x Q8 dot
products, in the decode step and in a forward (prefill, teacher-forced scores). Not bit-identical
to bf16 activations, so the model-level tests bound the difference (logits, greedy choices, the
quality gate's figures, perplexity) and assert exactly only what holds on every CPU: a row's
results alone or batched, on any thread count, with or without VNNI's instruction and in either
build are the same bits (integer sums are exact)."""

from __future__ import annotations

import functools

import pytest
import torch

from bench.bench_quality import GOLDEN
from mesh_common.ports import free_port
from meshlm.demo.launcher import _serving
from meshlm.demo.procs import Proc, wait_until
from model_runtime.engine import generate
from model_runtime.engine.kvcache import layout_decode
from model_runtime.engine.perplexity import decode_perplexity, perplexity, stdlib_text
from model_runtime.kernels import isas, qmm
from model_runtime.llm import native_step
from model_runtime.llm.quant import (
    Int4Linear,
    Int8Linear,
    pack_head_q8,
    pack_q8,
    use_int8_activations,
)
from model_runtime.loading.loader import load
from model_runtime.serving.client import Client
from model_runtime.serving.records import teacher_forced
from tests.test_native_step import BS, STORY, _prefilled, compare_steps
from xds_server.rollout.quality import Sample, agreement

BUILDS = [b for b in isas.BUILDS if isas.runs(b)]


def _q8_mm(build: str, layer, x: torch.Tensor, vnni: bool, threads: int = 2):
    """y = x @ W.T through q8.c (libqmm of `build`): int4mm_q8 for an Int4Linear, int8mm_q8
    for an Int8Linear (the head's kind)."""
    if isinstance(layer, Int4Linear):
        fn, codes, sz = "int4mm_q8", pack_q8(layer.packed), layer.scales_zeros
    else:
        fn, codes, sz = "int8mm_q8", pack_head_q8(layer.q), layer.scales
    y = torch.empty(x.shape[0], layer.out_features, dtype=torch.bfloat16)
    rc = getattr(qmm.library(build), fn)(
        x.data_ptr(), x.shape[0], layer.in_features, codes.data_ptr(), sz.data_ptr(),
        layer.out_features, y.data_ptr(), threads, int(vnni),
    )  # fmt: skip
    assert rc == 0
    return y


@functools.cache
def _layer(kind: str, n: int, k: int) -> tuple[Int4Linear | Int8Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    layer = Int4Linear.from_dense(w) if kind == "int4" else Int8Linear.from_dense(w)
    x = torch.randn(11, k, generator=g).to(torch.bfloat16)  # 11 rows: 8, then 3
    x[3] = 0  # an all-zero row: every group's scale is 0
    x[5, 7] = 40.0  # an outlier: its group's other values round to few levels
    return layer, x


SHAPES = [("int4", 576, 1536), ("int4", 960, 576), ("int8", 1024, 576)]


def _need_native():
    if not BUILDS or not qmm.applies():
        pytest.skip(f"no native kernels on this CPU: {qmm.why_not()}")


def test_pack_q8_puts_four_ks_of_a_column_in_a_lane():
    _need_native()
    n, k = 64, 64
    codes = (torch.arange(n)[:, None] * 7 + torch.arange(k)[None, :] * 3) % 16
    lin = Int4Linear.from_dense(codes.float())  # per group min 0, max 15: codes kept
    q8 = pack_q8(lin.packed)
    assert q8.shape == (n // 16, k // 8, 16, 4)
    for col, kk in [(0, 0), (5, 3), (17, 12), (63, 63), (40, 37)]:
        byte = int(q8[col // 16, kk // 8, col % 16, kk % 4])
        nibble = byte & 15 if kk % 8 < 4 else byte >> 4
        assert nibble == int(codes[col, kk]), (col, kk)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_activations_stay_close_to_the_exact_product(build, shape):
    _need_native()
    lin, x = _layer(*shape)
    exact = x.float() @ lin.dequantize().float().T
    y = _q8_mm(build, lin, x, vnni=False).float()
    rel = float((y - exact).norm() / exact.norm())
    # 8-bit activations: ~0.6 % here (bf16 output rounding alone ~0.2 %); wrong codes,
    # scales or zeros are off by tens of percent
    assert rel < 0.015, rel
    assert torch.equal(y[3], torch.zeros_like(y[3]))
    assert float((y[5] - exact[5]).norm() / exact[5].norm()) < 0.05


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("shape", SHAPES[1:])
def test_int8_activations_give_the_same_bits_alone_batched_any_threads_and_vnni(build, shape):
    _need_native()
    lin, x = _layer(*shape)
    ref = _q8_mm(build, lin, x, vnni=False)
    alone = torch.cat([_q8_mm(build, lin, x[i : i + 1].contiguous(), False) for i in range(11)])
    assert torch.equal(alone, ref)
    for threads in (1, 3):
        assert torch.equal(_q8_mm(build, lin, x, False, threads), ref)
    if isas.has_vnni(build):
        assert torch.equal(_q8_mm(build, lin, x, vnni=True), ref)


@pytest.mark.parametrize("shape", SHAPES[1:])
def test_both_builds_give_the_same_int8_activation_bits(shape):
    if len(BUILDS) < 2:
        pytest.skip("this CPU does not run both builds")
    lin, x = _layer(*shape)
    got = [_q8_mm(b, lin, x, isas.has_vnni(b)) for b in BUILDS]
    assert torch.equal(got[0], got[1])


@pytest.fixture(scope="module")
def int4_a8():
    lm = load(precision="int4", activations="int8")
    if native_step.why_not(lm.model) is not None:
        pytest.skip(f"no native decode step here: {native_step.why_not(lm.model)}")
    return lm


def test_load_says_it_computes_on_int8_activations(int4_a8, smollm_int4):
    assert int4_a8.info.version.endswith(":int4-a8")
    how = "VNNI" if isas.has_vnni(int4_a8.model.output.isa) else "no VNNI"
    assert f", int8 activations ({how}" in int4_a8.info.compute
    assert "; decode steps in one native call; prefill attention in one native call a layer" in (
        int4_a8.info.compute
    )
    assert "int8 activations" not in smollm_int4.info.compute
    # the second copy of the weights is counted
    assert int4_a8.info.weight_bytes > 1.5 * smollm_int4.info.weight_bytes
    with pytest.raises(ValueError, match="activations must be bf16 or int8"):
        load(precision="int4", activations="fp8")
    with pytest.raises(ValueError, match="activations int8 is for precision int4"):
        load(precision="bf16", activations="int8")


def test_int8_activations_refuse_layers_off_the_native_kernels(monkeypatch):
    monkeypatch.setenv("MESHLM_INT4_KERNEL", "torch")
    lin = Int4Linear.from_dense(torch.randn(64, 64))
    assert not lin.native
    with pytest.raises(ValueError, match="int8 activations need native layers"):
        use_int8_activations(torch.nn.Sequential(lin))
    with pytest.raises(ValueError, match="activations int8 need the native kernels"):
        load(precision="int4", activations="int8")


@torch.inference_mode()
def test_int8_activation_steps_stay_close_to_bf16_activation_steps(int4_a8, smollm_int4):
    """Teacher-forced over 24 steps of two rows: logits within a few bf16 steps of the bf16
    activations' native step, the same greedy choice on most rows and steps, and a row's logits
    the same bits alone as batched."""
    a8, ref_step = native_step.attach(int4_a8.model), native_step.attach(smollm_int4.model)
    assert a8.q8_mode() in (1, 2) and ref_step.q8_mode() == 0
    tok = smollm_int4.tokenizer
    prompts = [tok.encode_chat(STORY), tok.encode("The history of the city goes back to Rome.")]
    kv, seqs, nxt = _prefilled(smollm_int4, prompts)

    def step(tokens, lay):
        (ours, finite), (alone, _) = (
            a8(tokens, kv, lay),
            a8(tokens[:1], kv, layout_decode(seqs[:1], BS)),
        )
        ref, _ = ref_step(tokens, kv, lay)  # rewrites the slots with bf16 activations' K/V
        assert finite and torch.equal(ours[0], alone[0])
        return ours, ref

    worst, agree = compare_steps(seqs, nxt, 24, step)
    assert worst < 3.0, worst  # logits span ~40 (measured: ~1); garbage is off by tens
    assert agree >= 40, agree  # of 48


@torch.inference_mode()
def test_prefill_takes_int8_activations_too(int4_a8, smollm_int4):
    """One precision for the whole model, as the quality gate's teacher-forced scores (a
    forward over the answer) must see what decoding does: a forward's logits differ from bf16
    activations' but stay close, and its last row is what the decode step computes."""
    ids = torch.tensor([smollm_int4.tokenizer.encode_chat(STORY)])
    a8 = int4_a8.model(ids, all_logits=True)[0]
    ref = smollm_int4.model(ids, all_logits=True)[0]
    assert not torch.equal(a8, ref)
    assert float((a8 - ref).abs().max()) < 3.0
    assert float((a8.argmax(-1) == ref.argmax(-1)).float().mean()) > 0.8


@torch.inference_mode()
def test_int8_activations_pass_the_quality_gate_against_bf16(int4_a8, smollm_bf16):
    """What a rollout's quality gate measures for an int4-a8 canary against a bf16 stable
    (xds_server.rollout.quality's own figures): within the thresholds docs/OPERATIONS.md suggests
    (token disagreement 10 %, logprob drift 0.1 nats; a group-64 int4 reads 26 % and 0.41)."""
    tok = smollm_bf16.tokenizer
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in GOLDEN[:12]]
    stable = generate.greedy(smollm_bf16, ids, 12)
    canary = generate.greedy(int4_a8, ids, 12)
    samples = []
    for p, a, c in zip(ids, stable, canary, strict=True):
        st, ca = teacher_forced(smollm_bf16.model, p, a), teacher_forced(int4_a8.model, p, a)
        samples.append(Sample(a, c, st["argmax"], ca["argmax"], st["logprobs"], ca["logprobs"]))
    fig = agreement(samples)
    assert fig["token_disagreement"] <= 0.10, fig  # measured here: 4.4 % (0.011 nats)
    assert fig["logprob_drift"] <= 0.1, fig


@torch.inference_mode()
def test_int8_activations_keep_the_perplexity(int4_a8, smollm_int4):
    text = smollm_int4.tokenizer.encode(stdlib_text())
    for measure in (decode_perplexity, perplexity):
        ppl = [measure(lm.model, text, 256, 2) for lm in (smollm_int4, int4_a8)]
        # measured: +0.2 to +0.4 % (a forward a window, and through decode steps)
        assert ppl[1] < ppl[0] * 1.02, (measure.__name__, ppl)


def test_meshlm_serve_runs_on_int8_activations(tmp_path):
    """`meshlm serve --activations int8`: the real process serves it and says so in Info."""
    _need_native()
    port = free_port()
    args = ["serve", "--port", str(port), "--activations", "int8", "--max-batch", "2"]
    proc = Proc.meshlm("a8", args, tmp_path, env={"OMP_NUM_THREADS": "1"}).start()
    try:
        wait_until(lambda: _serving(port), 180, "runtime SERVING", proc)
        with Client(f"127.0.0.1:{port}") as c:
            info = c.info()
            assert info.version.endswith(":int4-a8")
            assert ", int8 activations (" in info.compute
            assert list(c.generate(prompt="Hello", max_new_tokens=2, timeout=60))
    finally:
        proc.stop()

"""The compute dtype chosen by the CPU's features at load (issue 13): a bf16 model computes in
fp32 where the CPU has no native bf16 matmuls (emulated here by capping oneDNN's ISA, as the
bench does) and answers as it does in bf16; the int4 model keeps its kernels and bf16
activations. Nothing here depends on which choice this CPU makes. The native int4/int8 kernels'
build follows the CPU's flags (AVX-512, else AVX2), or MESHLM_KERNEL_ISA where the CPU has it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from model_runtime.engine.perplexity import perplexity, stdlib_text
from model_runtime.kernels import compute, isas, qmm
from model_runtime.llm.quant import Int4Linear, Int8Linear
from model_runtime.loading.loader import load
from tests.test_model_quality import CONFIDENT, N_WINDOWS, WINDOW, greedy_chat


@contextlib.contextmanager
def no_native_bf16():
    with pytest.MonkeyPatch.context() as m:
        m.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")  # oneDNN: no bf16 instructions
        m.delenv("MESHLM_COMPUTE_DTYPE", raising=False)
        yield


@pytest.fixture(scope="module")
def bf16_without_native_bf16():
    with no_native_bf16():
        return load(precision="bf16")


def test_a_bf16_model_computes_in_fp32_where_bf16_would_be_emulated(bf16_without_native_bf16):
    lm = bf16_without_native_bf16
    assert lm.model.dtype == torch.float32
    assert lm.model.layers[0].attention.wqkv.weight.dtype == torch.float32
    assert lm.info.precision == "bf16" and lm.info.version.endswith(":bf16")
    with no_native_bf16():  # the CPU's lack where it has no bf16 instructions, else the cap
        why = compute.bf16_matmul_why_not()
    assert why is not None and why in lm.info.compute
    assert lm.info.compute.startswith("bf16 weights computed in fp32 (")


def test_the_fp32_choice_answers_as_int4_and_bf16_do(bf16_without_native_bf16, smollm_int4):
    prompt, answer = CONFIDENT[0]  # the capital of France
    ids = greedy_chat(bf16_without_native_bf16, prompt, 10)
    assert ids == greedy_chat(smollm_int4, prompt, 10)
    assert smollm_int4.tokenizer.decode(ids) == answer


def test_the_fp32_choice_keeps_the_perplexity(bf16_without_native_bf16, smollm_bf16):
    ids = smollm_bf16.tokenizer.encode(stdlib_text())
    fp32 = perplexity(bf16_without_native_bf16.model, ids, WINDOW, N_WINDOWS)
    bf16 = perplexity(smollm_bf16.model, ids, WINDOW, N_WINDOWS)
    assert abs(fp32 / bf16 - 1) < 0.01, (fp32, bf16)


def test_every_model_says_what_it_computes_in(smollm_int4, smollm_bf16):
    assert smollm_int4.info.compute.startswith("int4 weights on ")
    assert "bf16 activations" in smollm_int4.info.compute
    assert smollm_bf16.model.dtype == compute.choose("bf16").dtype
    assert smollm_bf16.info.compute.startswith(compute.choose("bf16").description + "; ")


def test_the_compute_dtype_can_be_forced_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv(compute.COMPUTE_ENV, "fp32")
    assert compute.choose("bf16").dtype == torch.float32
    monkeypatch.setenv(compute.COMPUTE_ENV, "bf16")
    assert compute.choose("bf16").dtype == torch.bfloat16
    assert compute.choose("int4").dtype == torch.bfloat16  # the int4 kernels take bf16
    monkeypatch.setenv(compute.COMPUTE_ENV, "fp16")
    with pytest.raises(ValueError, match=r"MESHLM_COMPUTE_DTYPE must be one of .*'fp16'"):
        compute.choose("bf16")


AVX2_ONLY = {"sse4_2", "avx", "avx2", "fma", "f16c"}  # an AVX2 EPYC's flags, in short
AVX512 = AVX2_ONLY | {"avx512f", "avx512bw"}


def test_the_native_build_follows_faked_cpu_flags_and_a_forced_one_they_lack_is_refused(
    monkeypatch,
):
    # other CPUs' /proc/cpuinfo flags stand in here (isas.cpu_flags): this machine has one
    # kind; the real flags pick the builds in test_quant_native and test_native_step
    monkeypatch.delenv(isas.ISA_ENV, raising=False)
    monkeypatch.delenv("MESHLM_INT4_KERNEL", raising=False)
    if not isas.runs("avx2"):
        pytest.skip("not an x86-64 Linux CPU with AVX2")
    monkeypatch.setattr(isas, "cpu_flags", lambda: set(AVX512))
    assert isas.isa() == "avx512"
    assert compute.choose("int4").description.startswith("int4 weights on native AVX-512 kernels")
    monkeypatch.setenv(isas.ISA_ENV, "avx2")  # forced: both are testable on one CPU
    assert isas.isa() == "avx2"
    assert compute.choose("int4").description.startswith("int4 weights on native AVX2 kernels")
    monkeypatch.delenv(isas.ISA_ENV)
    monkeypatch.setattr(isas, "cpu_flags", lambda: set(AVX2_ONLY))
    assert isas.isa() == "avx2" and qmm.applies()
    monkeypatch.setenv(isas.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match=r"MESHLM_KERNEL_ISA=avx512: this CPU lacks avx512bw"):
        isas.isa()
    with pytest.raises(ValueError):
        compute.choose("int4")
    monkeypatch.setenv(isas.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match=r"MESHLM_KERNEL_ISA must be one of \['avx2', 'avx512'\]"):
        isas.isa()
    monkeypatch.delenv(isas.ISA_ENV)
    monkeypatch.setattr(isas, "cpu_flags", lambda: AVX2_ONLY - {"fma"})
    assert isas.isa() is None
    assert qmm.why_not() == "the CPU lacks AVX-512 (F, BW) and AVX2 (with FMA, F16C)"
    assert "torch's kernels (the CPU lacks" in compute.choose("int4").description


def test_a_layer_keeps_the_build_it_was_made_with(monkeypatch):
    if not isas.runs("avx2"):
        pytest.skip("not an x86-64 Linux CPU with AVX2")
    monkeypatch.delenv("MESHLM_INT4_KERNEL", raising=False)
    monkeypatch.setenv(isas.ISA_ENV, "avx2")
    w = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    lin = Int4Linear.from_dense(w)
    head = Int8Linear.from_dense(w)
    assert (lin.isa, head.isa) == ("avx2", "avx2") and "native avx2" in repr(lin)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    before = lin(x), head(x)
    monkeypatch.delenv(isas.ISA_ENV)  # the CPU's own choice now: the layers keep theirs
    assert lin.isa == "avx2" and torch.equal(lin(x), before[0]) and torch.equal(head(x), before[1])

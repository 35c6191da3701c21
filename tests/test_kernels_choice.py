"""The compute dtype chosen by the CPU's features at load (issue 13): a bf16 model computes in
fp32 where the CPU has no native bf16 matmuls (emulated here by capping oneDNN's ISA, as the
bench does) and answers as it does in bf16; the int4 model keeps its kernels and bf16
activations. Nothing here depends on which choice this CPU makes."""

from __future__ import annotations

import contextlib

import pytest
import torch

from model_runtime import kernels
from model_runtime.loader import load
from model_runtime.perplexity import perplexity, stdlib_text
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
        why = kernels.bf16_matmul_why_not()
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
    assert smollm_bf16.model.dtype == kernels.choose("bf16").dtype
    assert smollm_bf16.info.compute == kernels.choose("bf16").description


def test_the_compute_dtype_can_be_forced_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv(kernels.COMPUTE_ENV, "fp32")
    assert kernels.choose("bf16").dtype == torch.float32
    monkeypatch.setenv(kernels.COMPUTE_ENV, "bf16")
    assert kernels.choose("bf16").dtype == torch.bfloat16
    assert kernels.choose("int4").dtype == torch.bfloat16  # the int4 kernels take bf16
    monkeypatch.setenv(kernels.COMPUTE_ENV, "fp16")
    with pytest.raises(ValueError, match=r"MESHLM_COMPUTE_DTYPE must be one of .*'fp16'"):
        kernels.choose("bf16")

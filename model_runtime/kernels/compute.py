"""What a model computes in on this CPU, chosen once at load: a bf16 model computes in fp32
where the CPU has no native bf16 matmuls; int4 runs on the native kernels where they apply."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from model_runtime.kernels import isas, qmm

# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) below avx512_core_bf16: with one set, oneDNN emulates bf16
# matmuls even where the CPU has the instructions (how the bench measures such a CPU here)
_NO_BF16_ISAS = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE"}
_NO_BF16_ISAS |= {"AVX512_CORE_VNNI"}
COMPUTE_ENV = "MESHLM_COMPUTE_DTYPE"
_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def bf16_matmul_why_not() -> str | None:
    """None when this CPU multiplies bf16 natively (avx512_bf16 or AMX-BF16, as oneDNN uses
    them), else why not."""
    flags = isas.cpu_flags()
    if not {"avx512_bf16", "amx_bf16"} & flags:
        return "the CPU has neither avx512_bf16 nor amx_bf16"
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if isa in _NO_BF16_ISAS:
        return f"ONEDNN_MAX_CPU_ISA={isa}"
    return None


@dataclass(frozen=True)
class Compute:
    """What a model of a given precision computes in on this CPU, chosen once at load."""

    dtype: torch.dtype  # of the dense weights and of the activations
    description: str  # one line for the log, `meshlm serve` and the bench


def choose(precision: str, device: str = "cpu", activations: str = "bf16") -> Compute:
    """The compute dtype for `precision` here. bf16 on a CPU without native bf16 matmuls runs
    as fp32 (the bf16 weights widened exactly, twice the memory): oneDNN emulates bf16 there,
    several times slower than fp32 (`python -m bench runtime` measures both).
    MESHLM_COMPUTE_DTYPE=bf16|fp32 overrides the choice for bf16 models.
    activations "int8" (int4 only): the quantized layers take int8 activations (q8.c); raises
    ValueError where the native kernels do not apply."""
    if activations == "int8":
        if precision != "int4":
            raise ValueError(f"activations int8 is for precision int4, not {precision}")
        if not qmm.applies() or device != "cpu":
            raise ValueError(f"activations int8 need the native kernels: {qmm.why_not() or device}")
        how = "VNNI" if isas.has_vnni(isas.isa()) else "no VNNI: two instructions a dot product"
        return Compute(
            torch.bfloat16, f"int4 weights on {isas.description()}, int8 activations ({how})"
        )
    if precision == "fp16":
        return Compute(torch.float16, "fp16 weights and activations")
    if precision == "fp32":
        return Compute(torch.float32, "fp32 weights and activations")
    if precision == "int4":
        kernel = isas.description() if qmm.applies() else f"torch's kernels ({qmm.why_not()})"
        return Compute(torch.bfloat16, f"int4 weights on {kernel}, bf16 activations")
    if device != "cpu":
        return Compute(torch.bfloat16, "bf16 weights and activations")
    forced = os.environ.get(COMPUTE_ENV)
    if forced is not None:
        if forced not in _COMPUTE_DTYPES:
            raise ValueError(
                f"{COMPUTE_ENV} must be one of {sorted(_COMPUTE_DTYPES)}, got {forced!r}"
            )
        return Compute(
            _COMPUTE_DTYPES[forced], f"bf16 weights computed in {forced} ({COMPUTE_ENV})"
        )
    why = bf16_matmul_why_not()
    if why is None:
        return Compute(torch.bfloat16, "bf16 weights and activations (native bf16 matmuls)")
    return Compute(torch.float32, f"bf16 weights computed in fp32 ({why}: bf16 would be emulated)")

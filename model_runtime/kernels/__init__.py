"""Native int4 and int8 weight-only matmuls (qmm.c; `python -m model_runtime.kernels.build`).

`applies()` says whether quantized layers built now use them (else torch's kernels); `library()`
loads them. One source, two builds (simd.h): AVX-512 F/BW (libqmm.so) and AVX2 + FMA + F16C
(libqmm_avx2.so), the same fp32 arithmetic in both, so they give the same bits on every CPU; the
AVX-512 build does two k steps of 16 outputs in one instruction where the CPU has avx512_bf16
(`has_bf16_dot`, qmm.c: the same bits as its FMAs). `isa()` picks the build for this CPU (x86-64
Linux only): AVX-512 where it has avx512f and avx512bw, else AVX2 where it has avx2, fma and f16c,
else none; MESHLM_KERNEL_ISA=avx2 (or avx512) forces one and is refused where the CPU lacks it.
The results are within one bf16 rounding of torch's int4pack and int8pack kernels (each adds the
same exact products in another order: most outputs the same bits, an output near 0, where the
terms cancel, may be more of its own bf16 steps apart, never 1e-4 of the largest output), and do
not depend on which kernels torch dispatches, so they are used wherever the CPU has one of the
two instruction sets. MESHLM_INT4_KERNEL=torch turns them off for the layers loaded while it is
set (benchmarks compare the two in one process). The int4 model keeps bf16 activations
everywhere.

`choose()` picks a model's compute dtype for this CPU at load (issue 13): a bf16 model computes
in fp32 where the CPU has no native bf16 matmuls.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from model_runtime.kernels.isas import ISAS, library_path

LIBRARY = library_path("qmm", "avx512")
ISA_ENV = "MESHLM_KERNEL_ISA"
# the CPU flags (/proc/cpuinfo) each build needs, in order of preference, and its name in logs
NEEDS = {"avx512": frozenset({"avx512f", "avx512bw"}), "avx2": frozenset({"avx2", "fma", "f16c"})}
NAMES = {"avx512": "AVX-512", "avx2": "AVX2"}
BUILDS = tuple(NEEDS)
assert NEEDS.keys() == ISAS.keys()


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def isa() -> str | None:
    """The build of the native kernels for this CPU ("avx512" or "avx2"), or None. Raises
    ValueError where MESHLM_KERNEL_ISA names an unknown build or one the CPU cannot run."""
    forced = os.environ.get(ISA_ENV, "")
    if forced and forced not in NEEDS:
        raise ValueError(f"{ISA_ENV} must be one of {sorted(NEEDS)}, got {forced!r}")
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        if forced:
            raise ValueError(f"{ISA_ENV}={forced}: the native kernels are built for x86-64 Linux")
        return None
    flags = _cpu_flags()
    if forced:
        lacks = sorted(NEEDS[forced] - flags)
        if lacks:
            raise ValueError(f"{ISA_ENV}={forced}: this CPU lacks {', '.join(lacks)}")
        return forced
    return next((name for name in NEEDS if runs(name)), None)


def runs(build: str) -> bool:
    """Whether this CPU runs `build` ("avx512" | "avx2")."""
    x86 = platform.system() == "Linux" and platform.machine() == "x86_64"
    return x86 and NEEDS[build] <= _cpu_flags()


# the CPU flag for VNNI's dot-product instruction in each build (kernels/q8.c, int8 activations)
VNNI = {"avx512": "avx512_vnni", "avx2": "avx_vnni"}


def has_vnni(build: str) -> bool:
    """Whether this CPU runs `build`'s VNNI instruction (else q8.c sums with two others)."""
    return runs(build) and VNNI[build] in _cpu_flags()


# the CPU flag for the bf16 dot-product instruction the int4 kernel uses where the CPU has it (the
# AVX-512 build only; the same bits without it)
BF16_DOT = {"avx512": "avx512_bf16", "avx2": None}


def has_bf16_dot(build: str) -> bool:
    """Whether `build`'s int4 kernel runs the dot-product instruction here (qmm.c)."""
    return runs(build) and BF16_DOT[build] in _cpu_flags()


def set_dot(lib: ctypes.CDLL, build: str, on: bool | None = None) -> None:
    """Turn the dot-product instruction of a library built from qmm.c on (default: where this
    CPU has it) or off; the results are the same bits either way."""
    lib.qmm_set_dot.argtypes = [ctypes.c_int]
    lib.qmm_set_dot(int(has_bf16_dot(build) if on is None else on and has_bf16_dot(build)))


def description(build: str | None = None) -> str:
    """How the logs name a build: "native AVX2 kernels"."""
    return f"native {NAMES[build or isa()]} kernels"


def why_not() -> str | None:
    """None when the native kernels apply here, else the reason they do not."""
    if os.environ.get("MESHLM_INT4_KERNEL", "native") == "torch":
        return "MESHLM_INT4_KERNEL=torch"
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"built for x86-64 Linux, this is {platform.system()} {platform.machine()}"
    build = isa()
    if build is None:
        return "the CPU lacks AVX-512 (F, BW) and AVX2 (with FMA, F16C)"
    path = library_path("qmm", build)
    if not path.exists():
        return f"{path.name} is not built (python -m model_runtime.kernels.build)"
    return None


def _gomp() -> ctypes.CDLL | None:
    """torch's own libgomp (already loaded: opening it again returns the same library)."""
    lib = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    try:
        return ctypes.CDLL(str(lib)) if lib.exists() else None
    except OSError:
        return None


def applies() -> bool:
    return why_not() is None


def library(build: str | None = None) -> ctypes.CDLL:
    """The quantized matmuls of `build` (default: this CPU's, `isa()`)."""
    build = build or isa()
    if build is None:
        raise RuntimeError(f"no native kernels here: {why_not()}")
    return _library(build)


@functools.cache
def _library(build: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library_path("qmm", build)))
    lib.int4mm_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.int4mm_bf16.argtypes += [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.int4mm_bf16.restype = ctypes.c_int
    lib.int8mm_bf16.argtypes = lib.int4mm_bf16.argtypes
    lib.int8mm_bf16.restype = ctypes.c_int
    for q8 in (lib.int4mm_q8, lib.int8mm_q8):  # q8.c: one more argument, vnni
        q8.argtypes = [*lib.int4mm_bf16.argtypes, ctypes.c_int]
        q8.restype = ctypes.c_int
    lib.qmm_set_gomp.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    set_dot(lib, build)
    gomp = _gomp()
    if gomp is not None:  # else one thread
        lib.qmm_set_gomp(
            ctypes.cast(gomp.GOMP_parallel, ctypes.c_void_p),
            ctypes.cast(gomp.omp_get_thread_num, ctypes.c_void_p),
        )
    return lib


# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) below avx512_core_bf16: with one set, oneDNN emulates bf16
# matmuls even where the CPU has the instructions (how the bench measures such a CPU here)
_NO_BF16_ISAS = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE"}
_NO_BF16_ISAS |= {"AVX512_CORE_VNNI"}
COMPUTE_ENV = "MESHLM_COMPUTE_DTYPE"
_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def bf16_matmul_why_not() -> str | None:
    """None when this CPU multiplies bf16 natively (avx512_bf16 or AMX-BF16, as oneDNN uses
    them), else why not."""
    flags = _cpu_flags()
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
    a 256-token prefill ~3.7x slower than fp32 (decode alike; `python -m bench runtime`
    measures both). MESHLM_COMPUTE_DTYPE=bf16|fp32 overrides the choice for bf16 models.
    activations "int8" (int4 only): the quantized layers take int8 activations (q8.c); raises
    ValueError where the native kernels do not apply."""
    if activations == "int8":
        if precision != "int4":
            raise ValueError(f"activations int8 is for precision int4, not {precision}")
        if not applies() or device != "cpu":
            raise ValueError(f"activations int8 need the native kernels: {why_not() or device}")
        how = "VNNI" if has_vnni(isa()) else "no VNNI: two instructions a dot product"
        return Compute(torch.bfloat16, f"int4 weights on {description()}, int8 activations ({how})")
    if precision == "fp16":
        return Compute(torch.float16, "fp16 weights and activations")
    if precision == "fp32":
        return Compute(torch.float32, "fp32 weights and activations")
    if precision == "int4":
        kernel = description() if applies() else f"torch's kernels ({why_not()})"
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

"""The builds of the native kernels (kernels/build.py makes them) and the one this CPU runs.

One source, two builds (simd.h): AVX-512 F/BW (libqmm.so, libstep.so) and AVX2 + FMA + F16C
(libqmm_avx2.so, libstep_avx2.so), the same fp32 arithmetic in both, so they give the same bits
on every CPU; the AVX-512 build does two k steps of 16 outputs in one instruction where the CPU
has avx512_bf16 (`has_bf16_dot`, qmm.c: the same bits as its FMAs). `isa()` picks the build for
this CPU (x86-64 Linux only): AVX-512 where it has avx512f and avx512bw, else AVX2 where it has
avx2, fma and f16c, else none; MESHLM_KERNEL_ISA=avx2 (or avx512) forces one and is refused where
the CPU lacks it.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> (the library's suffix, compiler flags)
ISAS = {
    "avx512": ("", ["-mavx512f", "-mavx512bw"]),
    "avx2": ("_avx2", ["-mavx2", "-mfma", "-mf16c"]),
}
ISA_ENV = "MESHLM_KERNEL_ISA"
# the CPU flags (/proc/cpuinfo) each build needs, in order of preference, and its name in logs
NEEDS = {"avx512": frozenset({"avx512f", "avx512bw"}), "avx2": frozenset({"avx2", "fma", "f16c"})}
NAMES = {"avx512": "AVX-512", "avx2": "AVX2"}
BUILDS = tuple(NEEDS)
assert NEEDS.keys() == ISAS.keys()
# the CPU flag for VNNI's dot-product instruction in each build (kernels/q8.c, int8 activations)
VNNI = {"avx512": "avx512_vnni", "avx2": "avx_vnni"}
# the CPU flag for the bf16 dot-product instruction the int4 kernel uses where the CPU has it (the
# AVX-512 build only; the same bits without it)
BF16_DOT = {"avx512": "avx512_bf16", "avx2": None}


def library_path(stem: str, isa: str) -> Path:
    """The library built from `stem`.c for `isa`: libqmm.so, libstep_avx2.so, ..."""
    return HERE / f"lib{stem}{ISAS[isa][0]}.so"


def cpu_flags() -> set[str]:
    """This CPU's flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
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
    flags = cpu_flags()
    if forced:
        lacks = sorted(NEEDS[forced] - flags)
        if lacks:
            raise ValueError(f"{ISA_ENV}={forced}: this CPU lacks {', '.join(lacks)}")
        return forced
    return next((name for name in NEEDS if runs(name)), None)


def runs(build: str) -> bool:
    """Whether this CPU runs `build` ("avx512" | "avx2")."""
    x86 = platform.system() == "Linux" and platform.machine() == "x86_64"
    return x86 and NEEDS[build] <= cpu_flags()


def has_vnni(build: str) -> bool:
    """Whether this CPU runs `build`'s VNNI instruction (else q8.c sums with two others)."""
    return runs(build) and VNNI[build] in cpu_flags()


def has_bf16_dot(build: str) -> bool:
    """Whether `build`'s int4 kernel runs the dot-product instruction here (qmm.c)."""
    return runs(build) and BF16_DOT[build] in cpu_flags()


def description(build: str | None = None) -> str:
    """How the logs name a build: "native AVX2 kernels"."""
    return f"native {NAMES[build or isa()]} kernels"

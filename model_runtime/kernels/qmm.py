"""Native int4 and int8 weight-only matmuls (qmm.c, in the build `isas.isa()` picks).

`applies()` says whether quantized layers built now use them (else torch's kernels); `library()`
loads them. The results are within one bf16 rounding of torch's int4pack and int8pack kernels
(each adds the same exact products in another order: most outputs the same bits, an output near
0, where the terms cancel, may be more of its own bf16 steps apart, never 1e-4 of the largest
output), and do not depend on which kernels torch dispatches, so they are used wherever the CPU
has one of the two instruction sets. MESHLM_INT4_KERNEL=torch turns them off for the layers
loaded while it is set (benchmarks compare the two in one process). The int4 model keeps bf16
activations everywhere.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path

import torch

from model_runtime.kernels import isas
from model_runtime.kernels.isas import library_path

LIBRARY = library_path("qmm", "avx512")


def set_dot(lib: ctypes.CDLL, build: str, on: bool | None = None) -> None:
    """Turn the dot-product instruction of a library built from qmm.c on (default: where this
    CPU has it) or off; the results are the same bits either way."""
    lib.qmm_set_dot.argtypes = [ctypes.c_int]
    dot = isas.has_bf16_dot(build)
    lib.qmm_set_dot(int(dot if on is None else on and dot))


def why_not() -> str | None:
    """None when the native kernels apply here, else the reason they do not."""
    if os.environ.get("MESHLM_INT4_KERNEL", "native") == "torch":
        return "MESHLM_INT4_KERNEL=torch"
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"built for x86-64 Linux, this is {platform.system()} {platform.machine()}"
    build = isas.isa()
    if build is None:
        return "the CPU lacks AVX-512 (F, BW) and AVX2 (with FMA, F16C)"
    path = library_path("qmm", build)
    if not path.exists():
        return f"{path.name} is not built (python -m model_runtime.kernels.build)"
    return None


def gomp() -> ctypes.CDLL | None:
    """torch's own libgomp (already loaded: opening it again returns the same library), whose
    thread team the native kernels run on; None: one thread."""
    lib = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    try:
        return ctypes.CDLL(str(lib)) if lib.exists() else None
    except OSError:
        return None


def applies() -> bool:
    return why_not() is None


def library(build: str | None = None) -> ctypes.CDLL:
    """The quantized matmuls of `build` (default: this CPU's, `isas.isa()`)."""
    build = build or isas.isa()
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
    team = gomp()
    if team is not None:  # else one thread
        lib.qmm_set_gomp(
            ctypes.cast(team.GOMP_parallel, ctypes.c_void_p),
            ctypes.cast(team.omp_get_thread_num, ctypes.c_void_p),
        )
    return lib

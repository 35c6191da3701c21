"""Native int4 and int8 weight-only matmuls (qmm.c; `python -m model_runtime.kernels.build`).

`applies()` says whether quantized layers built now use them (else torch's kernels); `library()`
loads them. They compute the same fp32 arithmetic as torch's AVX-512 int4pack and int8pack
kernels (bit-identical results), so they are used only on x86-64 Linux CPUs with AVX-512 (F and
BW) where torch dispatches its AVX-512 kernels. MESHLM_INT4_KERNEL=torch turns them off for the
layers loaded while it is set (benchmarks compare the two in one process).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
LIBRARY = HERE / "libqmm.so"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def why_not() -> str | None:
    """None when the native kernel applies here, else the reason it does not."""
    if os.environ.get("MESHLM_INT4_KERNEL", "native") == "torch":
        return "MESHLM_INT4_KERNEL=torch"
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"built for x86-64 Linux, this is {platform.system()} {platform.machine()}"
    if not {"avx512f", "avx512bw"} <= _cpu_flags():
        return "the CPU lacks AVX-512 (F, BW)"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX512_BF16", "AMX"):
        return f"torch dispatches {torch.backends.cpu.get_cpu_capability()} kernels, not AVX512"
    if not LIBRARY.exists():
        return f"{LIBRARY.name} is not built (python -m model_runtime.kernels.build)"
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


@functools.cache
def library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(LIBRARY))
    lib.int4mm_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.int4mm_bf16.argtypes += [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.int4mm_bf16.restype = ctypes.c_int
    lib.int8mm_bf16.argtypes = lib.int4mm_bf16.argtypes
    lib.int8mm_bf16.restype = ctypes.c_int
    lib.qmm_set_gomp.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    gomp = _gomp()
    if gomp is not None:  # else one thread
        lib.qmm_set_gomp(
            ctypes.cast(gomp.GOMP_parallel, ctypes.c_void_p),
            ctypes.cast(gomp.omp_get_thread_num, ctypes.c_void_p),
        )
    return lib

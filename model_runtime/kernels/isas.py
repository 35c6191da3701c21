"""The builds of the native kernels (kernels/build.py makes them, kernels/__init__.py picks one):
each instruction set's library suffix and compiler flags."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> (the library's suffix, compiler flags)
ISAS = {
    "avx512": ("", ["-mavx512f", "-mavx512bw"]),
    "avx2": ("_avx2", ["-mavx2", "-mfma", "-mf16c"]),
}


def library_path(stem: str, isa: str) -> Path:
    """The library built from `stem`.c for `isa`: libqmm.so, libstep_avx2.so, ..."""
    return HERE / f"lib{stem}{ISAS[isa][0]}.so"

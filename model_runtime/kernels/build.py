"""Build the native kernels: `python -m model_runtime.kernels.build [--check]`.

qmm.c (the quantized matmuls) and step.c (the decode step, which includes qmm.c), written against
simd.h, build with the pinned zig (PyPI `ziglang`, its clang) twice each: for AVX-512 F/BW
(libqmm.so, libstep.so) and for AVX2 + FMA + F16C (libqmm_avx2.so, libstep_avx2.so), committed
and shipped as package data like the Wasm filters, so an install needs no compiler
(kernels/qmm.py and llm/native_step.py load the build this CPU runs). `--check` rebuilds all
four into a temporary folder and fails if one differs from the committed file (CI runs it): the
shipped libraries are the ones their sources and the pinned zig produce.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from model_runtime.kernels.isas import HERE, ISAS, library_path

SOURCE = HERE / "qmm.c"
# the libraries: (source, library, isa)
TARGETS = [
    (HERE / f"{stem}.c", library_path(stem, isa), isa) for isa in ISAS for stem in ("qmm", "step")
]

# x86-64 Linux against glibc (the only symbols used are malloc, free, memcpy, memset and libm's
# expf, sqrtf); each library is loaded only where the CPU has its instruction set
# (kernels/isas.py). No debug info (-g0, -s): no source paths in the output, so builds are
# byte-identical.
CC_FLAGS = ["-target", "x86_64-linux-gnu", "-O3", "-shared", "-fPIC", "-g0", "-s"]


def build(out: Path, source: Path = SOURCE, isa: str = "avx512") -> Path:
    """Compile `source` for `isa` to the shared library `out`. Raises CalledProcessError on an
    error."""
    with tempfile.TemporaryDirectory(prefix="meshlm-zig-") as tmp:
        flags = [*CC_FLAGS[:3], *ISAS[isa][1], *CC_FLAGS[3:]]
        cmd = [sys.executable, "-m", "ziglang", "cc", *flags, "-o", str(out), source.name]
        env = {"ZIG_GLOBAL_CACHE_DIR": tmp, "ZIG_LOCAL_CACHE_DIR": tmp, "PATH": "/usr/bin:/bin"}
        subprocess.run(cmd, cwd=HERE, check=True, capture_output=True, text=True, env=env)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model_runtime.kernels.build", description=__doc__)
    p.add_argument("--check", action="store_true", help="rebuild and fail if bytes differ")
    args = p.parse_args(argv)
    for source, library, isa in TARGETS:
        rc = _one(source, library, isa, args.check)
        if rc:
            return rc
    return 0


def _one(source: Path, library: Path, isa: str, check: bool) -> int:
    try:
        if not check:
            build(library, source, isa)
            print(f"wrote {library} ({library.stat().st_size} bytes)")
            return 0
        with tempfile.TemporaryDirectory(prefix="meshlm-kernel-") as tmp:
            fresh = build(Path(tmp) / library.name, source, isa).read_bytes()
    except subprocess.CalledProcessError as e:
        print(f"zig cc of {source.name} for {isa} failed:\n{e.stderr}", file=sys.stderr)
        return 1
    if not library.exists() or library.read_bytes() != fresh:
        print(
            f"{library} is stale: rebuild with `python -m model_runtime.kernels.build` and "
            "commit it",
            file=sys.stderr,
        )
        return 1
    print(f"{library.name} is up to date ({len(fresh)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build the native kernels: `python -m model_runtime.kernels.build [--check]`.

qmm.c (the quantized matmuls) and step.c (the decode step, which includes qmm.c) build with the
pinned zig (PyPI `ziglang`, its clang) to libqmm.so and libstep.so, committed and shipped as
package data like the Wasm filters, so an install needs no compiler. `--check` rebuilds them
into a temporary folder and fails if one differs from the committed file (CI runs it): the
shipped libraries are the ones their sources and the pinned zig produce.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "qmm.c"
LIBRARY = HERE / "libqmm.so"
# source -> library
TARGETS = {SOURCE: LIBRARY, HERE / "step.c": HERE / "libstep.so"}

# x86-64 Linux against glibc (the only symbols used are malloc, free, memcpy, memset and libm's
# expf, sqrtf); AVX-512 F/BW code throughout, loaded only where the CPU has it
# (kernels/__init__.py). No debug info (-g0, -s): no source paths in the output, so builds are
# byte-identical.
CC_FLAGS = [
    "-target", "x86_64-linux-gnu", "-O3", "-mavx512f", "-mavx512bw",
    "-shared", "-fPIC", "-g0", "-s",
]  # fmt: skip


def build(out: Path, source: Path = SOURCE) -> Path:
    """Compile `source` to the shared library `out`. Raises CalledProcessError on an error."""
    with tempfile.TemporaryDirectory(prefix="meshlm-zig-") as tmp:
        cmd = [sys.executable, "-m", "ziglang", "cc", *CC_FLAGS, "-o", str(out), source.name]
        env = {"ZIG_GLOBAL_CACHE_DIR": tmp, "ZIG_LOCAL_CACHE_DIR": tmp, "PATH": "/usr/bin:/bin"}
        subprocess.run(cmd, cwd=HERE, check=True, capture_output=True, text=True, env=env)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model_runtime.kernels.build", description=__doc__)
    p.add_argument("--check", action="store_true", help="rebuild and fail if bytes differ")
    args = p.parse_args(argv)
    for source, library in TARGETS.items():
        rc = _one(source, library, args.check)
        if rc:
            return rc
    return 0


def _one(source: Path, library: Path, check: bool) -> int:
    try:
        if not check:
            build(library, source)
            print(f"wrote {library} ({library.stat().st_size} bytes)")
            return 0
        with tempfile.TemporaryDirectory(prefix="meshlm-kernel-") as tmp:
            fresh = build(Path(tmp) / library.name, source).read_bytes()
    except subprocess.CalledProcessError as e:
        print(f"zig cc of {source.name} failed:\n{e.stderr}", file=sys.stderr)
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

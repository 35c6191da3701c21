"""Build the authz filter: `python -m wasm_filters.build [--check]`.

The built `authz.wasm` is committed and shipped as package data. `--check` rebuilds into a
temporary folder and fails if the bytes differ from the committed file (CI runs it), so the
shipped module is always the one its source and the pinned zig (PyPI `ziglang`) produce.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "authz.zig"
WASM = HERE / "authz.wasm"

# Fixed flags: no debug info and no source paths in the output, so builds are byte-identical.
ZIG_FLAGS = [
    "-target", "wasm32-freestanding",
    "-fno-entry", "-rdynamic", "-fstrip",
    "-O", "ReleaseSmall",
]  # fmt: skip


def build(out: Path) -> Path:
    """Compile authz.zig to `out` (a .wasm path). Raises CalledProcessError on a compile error."""
    with tempfile.TemporaryDirectory(prefix="meshlm-zig-") as tmp:
        cmd = [
            sys.executable, "-m", "ziglang", "build-exe", SOURCE.name, *ZIG_FLAGS,
            f"-femit-bin={out}", "--cache-dir", str(Path(tmp) / "cache"),
        ]  # fmt: skip
        subprocess.run(cmd, cwd=HERE, check=True, capture_output=True, text=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wasm_filters.build", description=__doc__)
    p.add_argument("--check", action="store_true", help="rebuild and fail if bytes differ")
    args = p.parse_args(argv)
    try:
        if not args.check:
            build(WASM)
            print(f"wrote {WASM} ({WASM.stat().st_size} bytes)")
            return 0
        with tempfile.TemporaryDirectory(prefix="meshlm-wasm-") as tmp:
            fresh = build(Path(tmp) / "authz.wasm").read_bytes()
    except subprocess.CalledProcessError as e:
        print(f"zig build failed:\n{e.stderr}", file=sys.stderr)
        return 1
    if not WASM.exists() or WASM.read_bytes() != fresh:
        print(
            f"{WASM} is stale: rebuild with `python -m wasm_filters.build` and commit it",
            file=sys.stderr,
        )
        return 1
    print(f"{WASM.name} is up to date ({len(fresh)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

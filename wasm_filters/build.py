"""Build the Wasm filters: `python -m wasm_filters.build [--check]`.

Each module here (the authz filter, the class filter: MODULES) builds from `<name>.zig`, which
imports the proxy-wasm ABI glue of `proxy_wasm.zig`, to `<name>.wasm`, committed and shipped as
package data. `--check` rebuilds every module into a temporary folder and fails if any differs
from the committed file (CI runs it), so each shipped module is the one its source and the
pinned zig (PyPI `ziglang`) produce.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULES = ("authz", "classify")
SOURCE = HERE / "authz.zig"
WASM = HERE / "authz.wasm"
CLASSIFY_WASM = HERE / "classify.wasm"

# Fixed flags: no debug info and no source paths in the output, so builds are byte-identical.
ZIG_FLAGS = [
    "-target", "wasm32-freestanding",
    "-fno-entry", "-rdynamic", "-fstrip",
]  # fmt: skip
# The authz filter runs on every inbound request: speed over size.
OPTIMIZE = {"authz": "ReleaseFast"}


def build(out: Path, source: Path = SOURCE) -> Path:
    """Compile `source` (a .zig beside this file) to `out` (a .wasm path). Raises
    CalledProcessError on a compile error."""
    with tempfile.TemporaryDirectory(prefix="meshlm-zig-") as tmp:
        cmd = [
            sys.executable, "-m", "ziglang", "build-exe", source.name, *ZIG_FLAGS,
            "-O", OPTIMIZE.get(source.stem, "ReleaseSmall"),
            f"-femit-bin={out}", "--cache-dir", str(Path(tmp) / "cache"),
        ]  # fmt: skip
        subprocess.run(cmd, cwd=HERE, check=True, capture_output=True, text=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wasm_filters.build", description=__doc__)
    p.add_argument("--check", action="store_true", help="rebuild and fail if bytes differ")
    args = p.parse_args(argv)
    stale = 0
    for name in MODULES:
        source, wasm = HERE / f"{name}.zig", HERE / f"{name}.wasm"
        try:
            if not args.check:
                build(wasm, source)
                print(f"wrote {wasm} ({wasm.stat().st_size} bytes)")
                continue
            with tempfile.TemporaryDirectory(prefix="meshlm-wasm-") as tmp:
                fresh = build(Path(tmp) / wasm.name, source).read_bytes()
        except subprocess.CalledProcessError as e:
            print(f"zig build of {source.name} failed:\n{e.stderr}", file=sys.stderr)
            return 1
        if not wasm.exists() or wasm.read_bytes() != fresh:
            print(
                f"{wasm} is stale: rebuild with `python -m wasm_filters.build` and commit it",
                file=sys.stderr,
            )
            stale += 1
            continue
        print(f"{wasm.name} is up to date ({len(fresh)} bytes)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

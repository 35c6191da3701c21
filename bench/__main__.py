"""Run every benchmark (or those named) and assemble BENCHMARKS.md from their sections.

Each `bench/bench_<area>.py` has `main(quick: bool) -> str` returning a Markdown section that
states the machine, the command and the peer it compares against; the section is also kept in
`bench/results/<area>.md` so one area can be rerun without losing the others.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import bench

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"


def areas() -> list[str]:
    return sorted(
        m.name.removeprefix("bench_")
        for m in pkgutil.iter_modules(bench.__path__)
        if m.name.startswith("bench_")
    )


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench")
    p.add_argument("area", nargs="*", help=f"some of {areas()} (default: all)")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = p.parse_args()
    RESULTS.mkdir(exist_ok=True)
    chosen = args.area or areas()
    for area in chosen:
        if len(chosen) > 1:
            # Each area in a fresh process: one area's imports and models (torch, ~400 MiB)
            # must not show up in another's memory figures.
            cmd = [sys.executable, "-m", "bench", area] + (["--quick"] if args.quick else [])
            subprocess.run(cmd, check=True)
            continue
        mod = importlib.import_module(f"bench.bench_{area}")
        section = mod.main(quick=args.quick)
        (RESULTS / f"{area}.md").write_text(section.rstrip() + "\n")
        print(section)
    parts = [(RESULTS / f"{a}.md").read_text() for a in areas() if (RESULTS / f"{a}.md").exists()]
    header = (
        "# Benchmarks\n\nWritten by `make bench` (`python -m bench [AREA...]`); each section "
        "names the machine, the exact command and the peer it is compared with.\n\n"
    )
    (ROOT / "BENCHMARKS.md").write_text(header + "\n".join(parts))


if __name__ == "__main__":
    main()

"""Run every benchmark (or those named) and assemble BENCHMARKS.md from their sections.

Each `bench/bench_<area>.py` has `main(quick: bool) -> str` returning a Markdown section that
states the machine, the command and the peer it compares against; the section is also kept in
`bench/results/<area>.md` so one area can be rerun without losing the others. An area that
cannot measure on this machine (gpu, without a CUDA device) says why and returns None: its last
section stays.

An area whose figures depend on the CPU's instruction sets (`BY_CPU_KIND = True` in its module:
runtime, compute) keeps one section per CPU kind instead, `bench/results/<area>/<kind>.md`
(bench.machine.cpu_kind: 'AVX2 (AMD EPYC family 25)'); a run replaces only its own kind's section,
and BENCHMARKS.md shows them all under the area's heading, each as '### <heading>: <kind>'.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import bench
from bench.machine import anchor, cpu_kind

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"


def areas() -> list[str]:
    return sorted(
        m.name.removeprefix("bench_")
        for m in pkgutil.iter_modules(bench.__path__)
        if m.name.startswith("bench_")
    )


def _area_text(area: str) -> str | None:
    """The area's section, or its heading over one section per CPU kind measured so far."""
    kinds = sorted((RESULTS / area).glob("*.md"))
    if not kinds:
        flat = RESULTS / f"{area}.md"
        return flat.read_text() if flat.exists() else None
    sections = [k.read_text() for k in kinds]
    headings = [s.partition("\n")[0].removeprefix("### ") for s in sections]
    title = headings[0].rpartition(": ")[0]
    index = "".join(f"- [{h.rpartition(': ')[2]}](#{anchor(h)})\n" for h in headings)
    intro = (
        f"## {title}\n\nOne section per kind of CPU (the instruction sets the kernels are chosen "
        "by, then the CPU's name, an AMD CPU's with its family): speed does not carry over "
        f"between them. `python -m bench {area}` replaces only the section of the CPU it runs "
        f"on.\n\n{index}\n"
    )
    return intro + "\n".join(sections)


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
        if section is None:  # nothing to measure here (it said why): keep its last section
            continue
        section = section.rstrip() + "\n"
        path = RESULTS / f"{area}.md"
        if getattr(mod, "BY_CPU_KIND", False):
            title, _, rest = section.partition("\n")
            section = f"#{title}: {cpu_kind()}\n{rest}"  # '## T' -> '### T: AVX2 (Intel Xeon)'
            path = RESULTS / area / f"{anchor(cpu_kind())}.md"
            path.parent.mkdir(exist_ok=True)
        path.write_text(section)
        print(section)
    write_benchmarks()


def write_benchmarks() -> None:
    """BENCHMARKS.md from bench/results, as they are."""
    parts = [p for p in map(_area_text, areas()) if p is not None]
    header = (
        "# Benchmarks\n\nWritten by `make bench` (`python -m bench [AREA...]`); each section "
        "names the machine, the exact command and the peer it is compared with.\n\n"
    )
    (ROOT / "BENCHMARKS.md").write_text(header + "\n".join(parts))


if __name__ == "__main__":
    main()

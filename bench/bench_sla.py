"""The SLA engine with faults on, each mechanism off and on side by side in one run.

Every scenario that `meshlm demo --scenario NAME` shows and that exports `measure` (see
meshlm/demo/scenario.py) runs here twice on real processes (control plane, Envoys, model
runtimes): the same traffic and fault schedule with its mechanism off (what plain Envoy retries
and outlier detection give) and on. Each returns the `sla` object (meshlm/demo/sla.py) plus its own
figures; this module lays them out as one table per scenario with the on/off ratio.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from bench.machine import describe
from meshlm.demo import scenario

RESULTS = Path(__file__).resolve().parent / "results" / "sla.md"
# MESHLM_SLA_ONLY=stall,poison reruns those scenarios and keeps the others' last sections.
ONLY_ENV = "MESHLM_SLA_ONLY"


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif not isinstance(v, list):
            out[f"{prefix}{k}"] = v
    return out


def table(off: dict[str, Any], on: dict[str, Any]) -> list[str]:
    a, b = _flatten(off), _flatten(on)
    rows = ["| figure | off | on | on/off |", "|---|---|---|---|"]
    for k in [*a, *(k for k in b if k not in a)]:
        x, y = a.get(k), b.get(k)
        ratio = (
            f"{y / x:.2f}x"
            if isinstance(x, int | float) and isinstance(y, int | float) and x
            else ""
        )
        rows.append(f"| {k} | {_cell(x)} | {_cell(y)} | {ratio} |")
    return rows


def main(quick: bool = False) -> str:
    only = [n for n in os.environ.get(ONLY_ENV, "").split(",") if n]
    command, note = f"python -m bench sla{' --quick' if quick else ''}", ""
    if only:
        command = f"{ONLY_ENV}={','.join(only)} {command}"
        note = " (the other scenarios' sections are from the run before)"
    lines = [
        "## SLA under faults (`python -m bench sla`)",
        "",
        f"Machine: {describe()}. Command: `{command}`{note}. "
        "Peer: the same mesh with the mechanism off (plain Envoy retries and outlier "
        "detection). Real control plane, Envoys and model runtimes; availability counts OK calls "
        "and correct denials.",
        "",
    ]
    chosen = scenario.benched()
    kept = _sections(RESULTS.read_text()) if only and RESULTS.exists() else {}
    for name, mod in chosen:
        title = f"### {mod.BENCH_TITLE} (`--scenario {name}`)"
        if only and name not in only:
            if title in kept:
                lines.append(kept[title])
            continue
        t0 = time.monotonic()
        off = mod.measure(mechanism=False, quick=quick)
        on = mod.measure(mechanism=True, quick=quick)
        lines += [title, "", *table(off, on)]
        lines += ["", f"({time.monotonic() - t0:.0f} s for both runs)", ""]
    if not chosen:
        lines.append("No scenario exports `measure` yet.")
    return "\n".join(lines)


def _sections(text: str) -> dict[str, str]:
    """The previous run's scenario sections (heading -> the section, notes included)."""
    parts = text.split("\n### ")[1:]
    return {"### " + p.split("\n", 1)[0]: ("### " + p).rstrip() + "\n" for p in parts}


if __name__ == "__main__":
    print(main())

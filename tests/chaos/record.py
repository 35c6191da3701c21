"""What each chaos scenario survived: one record per scenario, rendered into RELIABILITY.md.

Scenarios call `record(...)` once, after their assertions ran (a failed scenario records too,
from a `finally`, with `passed=False`); the conftest writes the report at session end.
"""

from __future__ import annotations

import json
import platform
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

COMMAND = "make chaos  # = .venv/bin/python -m tests.chaos"
RECORDS: list[ScenarioRecord] = []


@dataclass
class ScenarioRecord:
    name: str  # the test function's name
    title: str
    load: str  # "8 req/s for 20 s of unary echo calls"
    faults: list[str]
    by_status: dict[str, int]  # every request sent, by final gRPC status
    allowed_lost: int  # requests that should have succeeded and did not
    recovery_s: float | None  # fault -> traffic healthy again (None: no outage to recover from)
    passed: bool = True
    details: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def sent(self) -> int:
        return sum(self.by_status.values())


def record(
    name: str,
    title: str,
    *,
    load: str,
    faults: list[str],
    by_status: Counter[str] | dict[str, int],
    allowed_lost: int,
    recovery_s: float | None,
    passed: bool = True,
    started: float | None = None,
    **details: Any,
) -> ScenarioRecord:
    rec = ScenarioRecord(
        name=name,
        title=title,
        load=load,
        faults=faults,
        by_status=dict(sorted(dict(by_status).items())),
        allowed_lost=allowed_lost,
        recovery_s=None if recovery_s is None else round(recovery_s, 2),
        passed=passed,
        details=details,
        wall_s=round(time.monotonic() - started, 1) if started else 0.0,
    )
    RECORDS[:] = [r for r in RECORDS if r.name != name] + [rec]
    return rec


def _cell(v: Any) -> str:
    if isinstance(v, float):
        v = round(v, 3)
    if isinstance(v, dict):
        v = ", ".join(f"{k}={_cell(x)}" for k, x in v.items())
    return str(v).replace("|", "\\|").replace("\n", " ")


def render(records: list[ScenarioRecord], *, elapsed_s: float, outcome: str) -> str:
    lines = [
        "# RELIABILITY",
        "",
        "What the mesh survived: real processes (control plane, Envoy sidecars, runtimes or tiny",
        "grpcio upstreams) on loopback, under steady generated load, with faults injected.",
        "This file is written by the chaos suite itself; do not edit it by hand.",
        "",
        f"Reproduce: `{COMMAND}`",
        "",
        f"Last run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on "
        f"{platform.machine()}, {_cpus()} CPUs, Python {platform.python_version()}; "
        f"suite wall time {elapsed_s:.0f} s; pytest outcome: {outcome}.",
        "",
        "| scenario | passed | load held | faults injected | sent | by gRPC status "
        "| allowed requests lost | recovery |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        rec = "n/a" if r.recovery_s is None else f"{r.recovery_s:.2f} s"
        lines.append(
            f"| {_cell(r.title)} | {'yes' if r.passed else '**NO**'} | {_cell(r.load)} "
            f"| {_cell('; '.join(r.faults))} | {r.sent} | {_cell(r.by_status)} "
            f"| {r.allowed_lost} | {rec} |"
        )
    for r in records:
        lines += ["", f"## {r.title}", "", f"Test: `tests/chaos` :: `{r.name}` ({r.wall_s} s)", ""]
        lines += ["| measure | value |", "|---|---|"]
        lines.append(f"| load held | {_cell(r.load)} |")
        for f in r.faults:
            lines.append(f"| fault | {_cell(f)} |")
        lines.append(f"| requests sent | {r.sent} |")
        for status, n in r.by_status.items():
            lines.append(f"| ended {status} | {n} |")
        lines.append(f"| allowed requests lost | {r.allowed_lost} |")
        lines.append(
            f"| recovery time | {'n/a' if r.recovery_s is None else f'{r.recovery_s:.2f} s'} |"
        )
        for k, v in r.details.items():
            lines.append(f"| {_cell(k)} | {_cell(v)} |")
    return "\n".join(lines) + "\n"


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def write_report(path: Path, *, elapsed_s: float, outcome: str) -> None:
    path.write_text(render(RECORDS, elapsed_s=elapsed_s, outcome=outcome))


def to_json() -> str:
    return json.dumps([asdict(r) for r in RECORDS], indent=1, default=str)

"""`make demo` as a benchmark (issue 13, item 5): the canary scenario, run as a user runs it
(`meshlm demo`, every part a real process), `rounds` times; per run the client's TTFT per
version that answered, the runtime's own TTFT and queue wait, and per analysis interval what the
gate read beside what the client saw. Goal: client TTFT p99 <= 1 s on a 2-core machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.machine import describe


def _run() -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as d:
        cmd = [sys.executable, "-m", "meshlm.cli", "demo", "--workdir", d]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        report = json.loads((Path(d) / "report.json").read_text())
    report["rc"] = proc.returncode
    return report


def main(quick: bool = False) -> str:
    rounds = 1 if quick else 3
    load = os.getloadavg()[0]
    lines = [
        "## The demo (`meshlm demo`, canary scenario)",
        "",
        f"{describe()}. Command: `python -m bench demo` ({rounds} runs of "
        "`meshlm demo`; acme 3 calls/s, free 1/s rate-limited, 8 new tokens each; v1 bf16 "
        "stable, v2 int4 canary, one torch thread per runtime).",
        "",
        "| run | state | version | calls | client TTFT p50 / p99 ms | runtime TTFT p99 ms "
        "| runtime queue wait p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    steps = []
    for i in range(rounds):
        r = _run()
        t = r["traffic"]
        lines.append(
            f"| {i + 1} | {r['rollout']['state']} | all | {t['ok']} | "
            f"{t['ttft_ms']['p50']} / {t['ttft_ms']['p99']} | | |"
        )
        for v, b in t["by_version"].items():
            lines.append(
                f"| {i + 1} | | {v} | {b['count']} | {b['ttft_ms']['p50']} / "
                f"{b['ttft_ms']['p99']} | {b['server_ttft_ms']['p99']} | "
                f"{b['queue_wait_ms']['p99']} |"
            )
        for s in r["steps"]:
            v2 = s["client_ttft_ms"].get("v2", {})
            steps.append(
                f"| {i + 1} | {s['step'] + 1} @ {s['canary_weight']}% | {s['outcome']} | "
                f"{s['gate_ttft_p99_ms']} ({s['gate_samples']}) | {v2.get('p99')} "
                f"({v2.get('count', 0)}) |"
            )
    lines += [
        "",
        "Per analysis interval: the gate's TTFT p99 (the canary runtime's histograms over exactly "
        "the interval) beside the client's p99 of v2's calls whose first token came in it:",
        "",
        "| run | step | verdict | gate p99 ms (calls) | client v2 p99 ms (calls) |",
        "|---|---|---|---|---|",
        *steps,
        "",
        f"Load average at start {load:.1f}, at end {os.getloadavg()[0]:.1f}.",
    ]
    return "\n".join(lines)

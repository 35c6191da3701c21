"""`meshlm demo [--scenario NAME]`: the local mesh end to end, as real processes on loopback.
The default scenario is the canary rollout (meshlm/demo/scenarios/canary.py); each other scenario
shows one mechanism of the SLA engine with its faults. Every scenario prints its progress and a
report, writes `report.json` in the work dir and stops every process it started."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshlm.demo.scenario import SCENARIOS, load


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="canary",
        help="what to show (default: canary, the SLO-gated rollout of v2)",
    )
    p.add_argument(
        "--faulty-canary",
        action="store_true",
        help="the same as --scenario faulty-canary: errors and latency in v2, watch the rollback",
    )
    p.add_argument("--workdir", type=Path, help="logs, mesh file and report (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=600, help="give up after this many seconds")


def run(args: argparse.Namespace) -> int:
    if args.workdir is not None and not args.workdir.is_dir():
        print(f"meshlm demo: --workdir {args.workdir}: no such directory", file=sys.stderr)
        return 2
    name = "faulty-canary" if args.faulty_canary else args.scenario
    if args.faulty_canary and args.scenario not in ("canary", "faulty-canary"):
        print("meshlm demo: --faulty-canary is the canary scenario's", file=sys.stderr)
        return 2
    return load(name).run(args, name)

"""The scenarios of `meshlm demo --scenario NAME` (modules in meshlm/demo/scenarios/) and what
they share. Each scenario is a module with `run(args, name) -> int` that
starts a local mesh, drives traffic and faults, prints a report, writes `report.json` in the
work dir and stops every process. A scenario that `python -m bench sla` also runs exports
`measure(mechanism: bool, quick: bool) -> dict` (the same traffic and faults with its mechanism
off and on) and `BENCH_TITLE`."""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

# name -> module; the canary module runs both of its names.
SCENARIOS: dict[str, str] = {
    "canary": "meshlm.demo.scenarios.canary",
    "faulty-canary": "meshlm.demo.scenarios.canary",
    "bad-model": "meshlm.demo.scenarios.canary",  # bad_model.py: its canary and report
    "noisy-tenant": "meshlm.demo.scenarios.noisy_tenant",
    "token-budget": "meshlm.demo.scenarios.token_budget",
    "hot-replica": "meshlm.demo.scenarios.hot_replica",
    "poison": "meshlm.demo.scenarios.poison",
    "stall": "meshlm.demo.scenarios.stall",
    "slo": "meshlm.demo.scenarios.slo",
    "multi-host": "meshlm.demo.scenarios.multi_host",
    "zone-loss": "meshlm.demo.scenarios.zone_loss",
    "shared-prefix": "meshlm.demo.scenarios.shared_prefix",
    "jittery-host": "meshlm.demo.scenarios.jittery_host",
}


def say(msg: str) -> None:
    """A scenario's progress line."""
    print(f"  {msg}", flush=True)


def report_of(
    title: str, produce: Callable[[], dict[str, Any]], hide: tuple[str, ...] = ()
) -> dict[str, Any] | None:
    """What a scenario's run() does around its one run: say what it shows, run it, print the
    report (but the keys in `hide`, which the scenario shows its own way) and where its
    report.json is. None, with the reason printed, when the mesh failed (a port taken, a
    process that died, a timeout)."""
    print(f"meshlm demo --scenario {title}")
    try:
        report = produce()
    except (TimeoutError, RuntimeError, OSError) as e:
        print(f"meshlm demo: {e}", file=sys.stderr)
        return None
    print(json.dumps({k: v for k, v in report.items() if k not in hide}, indent=2))
    print(f"JSON report: {report['workdir']}/report.json")
    return report


@contextlib.contextmanager
def running(mesh: Any, say: Callable[[str], None]) -> Iterator[contextlib.ExitStack]:
    """Start `mesh` (a meshlm.demo.launcher.LocalMesh) for the block; after it, whatever happened,
    run the stops the block put on the stack (`stack.callback(traffic.stop)`), last first, then
    stop every process of the mesh."""
    with contextlib.ExitStack() as stack:

        @stack.callback
        def _stop_mesh() -> None:
            mesh.stop()
            say("all processes stopped")

        mesh.start(say=say)
        yield stack


def write_report(workdir: Path, report: dict[str, Any]) -> None:
    (workdir / "report.json").write_text(json.dumps(report, indent=2))


def load(name: str) -> ModuleType:
    return importlib.import_module(SCENARIOS[name])


def benched() -> list[tuple[str, ModuleType]]:
    """The scenarios `python -m bench sla` runs, in the order they are listed."""
    mods = [(n, load(n)) for n in SCENARIOS]
    return [(n, m) for n, m in mods if hasattr(m, "measure")]

"""`meshlm demo --scenario NAME`: each scenario is a module with `run(args, name) -> int` that
starts a local mesh, drives traffic and faults, prints a report, writes `report.json` in the
work dir and stops every process. A scenario that `python -m bench sla` also runs exports
`measure(mechanism: bool, quick: bool) -> dict` (the same traffic and faults with its mechanism
off and on) and `BENCH_TITLE`."""

from __future__ import annotations

import importlib
from types import ModuleType

# name -> module; the canary module runs both of its names.
SCENARIOS: dict[str, str] = {
    "canary": "meshlm.scenarios.canary",
    "faulty-canary": "meshlm.scenarios.canary",
    "noisy-tenant": "meshlm.scenarios.noisy_tenant",
    "hot-replica": "meshlm.scenarios.hot_replica",
    "poison": "meshlm.scenarios.poison",
    "stall": "meshlm.scenarios.stall",
    "slo": "meshlm.scenarios.slo",
}


def say(msg: str) -> None:
    """A scenario's progress line."""
    print(f"  {msg}", flush=True)


def load(name: str) -> ModuleType:
    return importlib.import_module(SCENARIOS[name])


def benched() -> list[tuple[str, ModuleType]]:
    """The scenarios `python -m bench sla` runs, in the order they are listed."""
    mods = [(n, load(n)) for n in SCENARIOS]
    return [(n, m) for n, m in mods if hasattr(m, "measure")]

"""Running a `meshlm demo --scenario` across network namespaces from a test, and checking that
the run left nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_host_demo(scenario: str, workdir: Path, timeout: int) -> dict[str, Any]:
    """Run the scenario in `workdir` (the CLI's own --timeout is `timeout`); its report, once
    it exited 0 with every goal met."""
    done = subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "demo", "--scenario", scenario,
         "--workdir", str(workdir), "--timeout", str(timeout)],
        capture_output=True, text=True, timeout=timeout + 160,
    )  # fmt: skip
    out = done.stdout + done.stderr
    report = json.loads((workdir / "report.json").read_text())
    assert done.returncode == 0, out[-6000:]
    assert all(report["goals"].values()), report["goals"]
    return report


def processes_left(workdir: Path) -> list[str]:
    """Processes still running whose command line names the run's work dir."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(workdir) in cmd:
            left.append(f"{pid}: {cmd[:200]}")
    return left


def assert_nothing_left(report: dict[str, Any], workdir: Path, namespaces: int) -> None:
    """The run made `namespaces` namespaces, deleted them all, and left no process."""
    assert report["namespaces_left"] == []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert len(report["namespaces"]) == namespaces
    assert not set(report["namespaces"]) & {line.split()[0] for line in netns.splitlines()}
    assert processes_left(workdir) == []

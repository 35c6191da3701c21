"""`meshlm demo --scenario multi-host` end to end: real network namespaces on a bridge, the real
control plane, real Envoys and real runtimes in them, real mTLS between hosts. One run, its
report checked for each behaviour; and the refusal (exit 2) where namespaces cannot be made."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

from meshlm.demo.hosts import SUBNET_PREFIX


def _ours_left(workdir: Path) -> list[str]:
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


def test_multi_host_demo(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "demo", "--scenario", "multi-host",
         "--workdir", str(tmp_path), "--timeout", "400"],
        capture_output=True, text=True, timeout=560,
    )  # fmt: skip
    out = done.stdout + done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert done.returncode == 0, out[-6000:]
    assert all(report["goals"].values()), report["goals"]

    # Every runtime host joined by registration: none is in the mesh file, all three are in
    # the control plane's table, each timed from SERVING to the caller's Envoy holding it.
    assert report["endpoints_in_mesh_file"] == []
    joins = report["joins"]
    assert {j["version"] for j in joins.values()} == {"v1", "v2"}
    assert sorted(j["address"] for j in joins.values()) == report["registered_at_control_plane"]
    for j in joins.values():
        assert not j["address"].startswith("127."), j
        assert j["address"].startswith(SUBNET_PREFIX), j
        assert j["serving_to_registered_s"] >= 0 and j["registered_to_caller_acked_s"] >= 0
    # The rollout stepped through the control plane to 100 % v2.
    assert report["rollout"]["state"] == "Succeeded"
    weights = [s["canary_weight"] for s in report["rollout"]["steps"]]
    assert {20, 50, 100} <= set(weights), weights
    # Availability through partition and scale-in, and nothing lost by the drain.
    assert report["availability_percent"] >= 99.9
    assert report["calls"]["total"] >= 20
    scale_in = report["scale_in"]
    assert scale_in["calls_lost"] == 0 and scale_in["sidecar_exit"] == 0
    assert scale_in["deregistration_line"] and scale_in["caller_dropped_it"]
    # The calls running at the cut are each counted once: resumed, moved, finished, or failed
    # with a status.
    cut = report["partition"]["calls_in_flight_at_the_cut"]
    assert sum(v for k, v in cut.items() if k != "total") == cut["total"]
    assert report["partition"]["back_in_pool_s_after_heal"] is not None
    # Nothing left behind: no namespace, no process of the run.
    assert report["namespaces_left"] == []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert len(report["namespaces"]) == 5
    assert not set(report["namespaces"]) & {line.split()[0] for line in netns.splitlines()}
    assert _ours_left(tmp_path) == []


def test_without_namespaces_it_exits_2_and_says_why() -> None:
    nobody = pwd.getpwnam("nobody")
    done = subprocess.run(
        [
            *("setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"),
            *(sys.executable, "-m", "meshlm.cli", "demo", "--scenario", "multi-host"),
        ],
        capture_output=True, text=True, timeout=120, cwd=os.getcwd(),
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "lacks CAP_NET_ADMIN and CAP_SYS_ADMIN" in done.stderr, done.stderr
    assert "logs and report in" not in done.stdout  # refused before anything started

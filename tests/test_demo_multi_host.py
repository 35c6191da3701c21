"""`meshlm demo --scenario multi-host` end to end: real network namespaces on a bridge, the real
control plane, real Envoys and real runtimes in them, real mTLS between hosts. One run, its
report checked for each behaviour; and the refusal (exit 2) where namespaces cannot be made."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

from meshlm.demo.hosts import SUBNET_PREFIX
from tests.demo_support import assert_nothing_left, run_host_demo


def test_multi_host_demo(tmp_path: Path) -> None:
    report = run_host_demo("multi-host", tmp_path, timeout=400)

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
    assert_nothing_left(report, tmp_path, namespaces=5)


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

"""`meshlm demo --scenario zone-loss` end to end: real network namespaces on a bridge, the real
control plane, real Envoys and real runtimes in two zones; the caller's zone is cut off mid-traffic
and healed, three times. One run, its report checked against the goals."""

from __future__ import annotations

from pathlib import Path

from meshlm.demo.hosts import SUBNET_PREFIX
from tests.demo_support import assert_nothing_left, run_host_demo


def test_zone_loss_demo(tmp_path: Path) -> None:
    report = run_host_demo("zone-loss", tmp_path, timeout=300)

    # Both zones joined by registration, each host in its own zone, on the bridge's addresses.
    joins = report["joins"]
    assert {j["zone"] for j in joins.values()} == {"zone-a", "zone-b"}
    assert all(j["address"].startswith(SUBNET_PREFIX) for j in joins.values()), joins
    assert report["locality"] is True and report["zones"]["caller"] == "zone-a"
    # Calls stayed in zone-a while it was healthy, went to zone-b within 2 s of each cut, came
    # back after each heal, and every allowed call was served.
    assert report["calls_before_the_loss"] >= 5
    assert report["in_zone_share"] >= 95.0
    losses = report["partition"]["losses"]
    assert losses >= 3 and len(report["failovers_s"]) == len(report["failbacks_s"]) == losses
    assert all(t is not None and 0 <= t <= 2.0 for t in report["failovers_s"]), report
    assert report["failover_s"] == max(report["failovers_s"])
    assert all(t is not None and t >= 0 for t in report["failbacks_s"]), report
    assert report["sla"]["availability"] >= 99.9
    zone_b = joins["b1"]["address"]
    assert report["calls"]["by_replica"].get(zone_b, 0) >= 1
    # Nothing left behind: no namespace, no process of the run.
    assert_nothing_left(report, tmp_path, namespaces=4)

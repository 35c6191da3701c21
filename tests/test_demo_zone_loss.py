"""`meshlm demo --scenario zone-loss` end to end: real network namespaces on a bridge, the real
control plane, real Envoys and real runtimes in two zones; the caller's zone is cut off mid-traffic
and healed. One run, its report checked against the goals."""

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
    # Calls stayed in zone-a while it was healthy, went to zone-b within 2 s of the cut, came
    # back after the heal, and every allowed call was served.
    assert report["calls_before_the_loss"] >= 5
    assert report["in_zone_share"] >= 95.0
    assert 0 <= report["failover_s"] <= 2.0
    assert report["failback_s"] is not None and report["failback_s"] >= 0
    assert report["sla"]["availability"] >= 99.9
    zone_b = joins["b1"]["address"]
    assert report["calls"]["by_replica"].get(zone_b, 0) >= 1
    # Nothing left behind: no namespace, no process of the run.
    assert_nothing_left(report, tmp_path, namespaces=4)

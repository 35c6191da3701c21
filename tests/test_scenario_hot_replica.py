"""`meshlm demo --scenario hot-replica` end to end on real processes (control plane, three Envoys,
two real model runtimes, one slowed by `--fault-slow-decode 2`), kept short: the report has the
`sla` object, `share_by_replica` and the measured speeds the offered rate came from, the
caller's Envoy balanced on the runtimes' ORCA reports, and every process is gone afterwards.
That Envoy follows the reports is shown in tests/test_lb_least_loaded.py; the slow replica's
larger reported load in tests/test_orca_reports.py. The offered rate's arithmetic is checked
without processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshlm.demo.scenario import SCENARIOS
from meshlm.demo.scenarios import hot_replica

# Times real processes against its own baseline or a deadline: not beside another test (-n 2).
pytestmark = pytest.mark.alone


def test_offered_load_overloads_the_slow_replica_under_round_robin_only() -> None:
    """The rate follows the slow replica's measured speed (a fixed rate loaded one machine and
    idled another): at round robin's even split the slow replica is asked LOAD > 1 times what
    it serves, while a replica SLOW_FACTOR times faster beside it leaves both together room."""
    slow_factor, tokens = float(hot_replica.SLOW_FACTOR), hot_replica.MAX_NEW_TOKENS
    for slow in (20.0, 50.0, 120.0):  # tokens/s in MAX_BATCH slots
        asked = hot_replica.offered_rate(slow) * tokens  # tokens/s
        assert asked / 2 / slow == pytest.approx(hot_replica.LOAD, rel=0.02), (slow, asked)
        assert asked < 0.9 * (slow + slow_factor * slow), (slow, asked)
    assert hot_replica.LOAD >= 1.3
    assert hot_replica.offered_rate(1e6) == hot_replica.RATE_BOUNDS[1]
    assert hot_replica.offered_rate(0.0) == hot_replica.RATE_BOUNDS[0]


def test_hot_replica_reports_shares_and_the_sla(tmp_path: Path) -> None:
    assert SCENARIOS["hot-replica"] == "meshlm.demo.scenarios.hot_replica"
    report = hot_replica._run(
        load_balancing="least_loaded", seconds=15.0, workdir=tmp_path, say=print
    )
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert report["load_balancing"] == "least_loaded"
    assert set(report["sla"]) == {"requests", "ok", "availability", "ttft_ms", "e2e_ms"}
    assert report["sla"]["ok"] > 0 and report["sla"]["availability"] == 100.0
    shares = report["share_by_replica"]
    assert set(shares) == {"v1-0", "v1-1"} and abs(sum(shares.values()) - 1) < 0.01
    # The offered rate came from both replicas' speeds, measured at once on this machine.
    speeds = report["tokens_per_s_by_replica"]
    assert set(speeds) == {"v1-0", "v1-1"} and all(v > 0 for v in speeds.values())
    assert report["offered_rate_per_s"] == hot_replica.offered_rate(speeds["v1-1"])
    # No share is asserted here: 15 s of calls, the first seconds on the warm-up's weights,
    # cannot tell 0.33 from 0.5. Envoy following the reports is tests/test_lb_least_loaded.py,
    # the slow replica reporting more load is tests/test_orca_reports.py, the share over full
    # runs is in BENCHMARKS.md.
    assert sum(report["served_by_replica"].values()) == report["sla"]["ok"]
    # The caller's Envoy read both runtimes' out-of-band load reports through their sidecars.
    assert report["orca_reports_received"] > 0

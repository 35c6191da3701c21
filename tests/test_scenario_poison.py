"""`meshlm demo --scenario poison` end to end on real processes, with short phases: a query of
death (every runtime runs `--fault-poison`) is quarantined to the isolation pool within seconds,
the main pool never sees it again, and every process is stopped."""

from __future__ import annotations

import pytest

from meshlm.demo.scenario import SCENARIOS, load
from tests.test_demo_e2e import _processes_of

# Times real processes against its own baseline or a deadline: not beside another test (-n 2).
pytestmark = pytest.mark.alone


def test_poison_scenario_quarantines_the_query_of_death(tmp_path) -> None:
    poison = load("poison")
    assert SCENARIOS["poison"] == "meshlm.demo.scenarios.poison"
    key = poison.poison_class()
    assert len(key) == 16
    report = poison._run(mechanism=True, phases=(5.0, 25.0), workdir=tmp_path, say=print)
    assert set(report["sla"]) >= {"requests", "ok", "availability", "ttft_ms", "e2e_ms"}
    assert set(report["sla"]["e2e_ms"]) == {"p50", "p99", "p999"}
    assert report["poison_class"] == key
    quarantined = {q["key"]: q for q in report["quarantined_classes"]}
    assert key in quarantined and "failed" in quarantined[key]["why"]
    assert quarantined[key]["when"].endswith("Z")
    assert report["time_to_quarantine_s"] is not None and report["time_to_quarantine_s"] < 20
    assert report["runtime_restarts_total"] >= 1  # the launcher restarted what the poison killed
    # Before it, a poison call kills the one replica it reached, not the next one too (its
    # runtime died holding it: the caller's sidecar does not retry it).
    assert 1 <= report["main_restarts_at_quarantine"] <= report["poison_calls_before_quarantine"]
    # After the quarantine the main pool never sees the poison again.
    assert report["restarts_of_main_after_quarantine"] == 0
    assert report["healthy_availability"] is not None
    assert (tmp_path / "report.json").is_file()
    assert _processes_of(tmp_path) == []

"""`meshlm demo --scenario slo` end to end on real processes (control plane with `--scaler
local`, Envoys, the real model): a load step breaches the TTFT p99 SLO, the loop sheds the
low-priority tenant with a reason, the SLO is met again within the bound, the shed is undone
after the step and nothing flaps (issue 12, item 4 and the goal of item 6)."""

from __future__ import annotations

import json

import pytest

from meshlm.demo.scenarios import slo

# Times real processes against its own baseline or a deadline: not beside another test (-n 2).
pytestmark = pytest.mark.alone


def test_slo_loop_restores_a_breached_ttft_slo_and_undoes_after_the_step(tmp_path) -> None:
    r = slo.scenario(workdir=tmp_path, act=True, say=print)
    assert json.loads((tmp_path / "report.json").read_text())["scenario"] == "slo"
    first = r["actions"][0]
    assert (first["action"], first["direction"]) == ("shed", "apply")
    assert first["reason"].startswith("TTFT p99 ") and "for 2 intervals" in first["reason"]
    assert first["done"] == "rate limits of free cut to a quarter"
    # Bound: INTERVALS (2) breached before the loop may act, then the drain of the calls queued
    # before the shed (2). Every interval is measured, a replica starting meanwhile or not (the
    # loop's scale-out no longer blocks it). The demo reports this bound beside the 3.
    assert r["intervals_to_restore"] is not None, r["timeline"]
    assert r["intervals_to_restore"] <= slo.INTERVALS + slo.drain_intervals(), r["timeline"]
    # Undone once the SLO held for recover_intervals, after the step, and never applied again.
    assert r["undone_after_step"], r["actions"]
    step_s = r["traffic"]["step_s"]
    assert all(a["t_s"] >= step_s for a in r["actions"] if a["direction"] == "undo")
    assert not r["flapped"], r["actions"]
    # The high-priority tenant was served throughout (the loop never shed it).
    assert r["sla"]["requests"] > 0 and r["sla"]["availability"] == 100.0

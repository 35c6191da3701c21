"""`meshlm demo --scenario token-budget` end to end on real processes (control plane, Envoys with
the Wasm authz filter, an int4 runtime), at its smoke durations: the noisy tenant's flood is held
to its token budget, counted by the runtime's own usage counters, while the quiet tenant is
served."""

from __future__ import annotations

from pathlib import Path

from meshlm.demo.scenario import SCENARIOS
from meshlm.demo.scenarios import token_budget


def test_a_flood_is_held_to_its_token_budget(tmp_path: Path) -> None:
    assert SCENARIOS["token-budget"] == token_budget.__name__
    report = token_budget.measure_run(True, "smoke", workdir=tmp_path, say=lambda m: None)
    noisy = report["tenants"]["noisy"]["by_status"]
    assert noisy.get("RESOURCE_EXHAUSTED", 0) > 0 and noisy.get("OK", 0) > 0, noisy
    assert 0 < report["noisy_billed_tokens"] <= report["noisy_allowed_tokens"]
    assert report["budget_overshoot_pct"] == 0
    quiet = report["tenants"]["quiet"]["by_status"]
    assert quiet.get("OK", 0) > 0 and set(quiet) == {"OK"}, quiet
    assert report["quiet_ttft_p99_ratio"] is not None
    assert (tmp_path / "report.json").exists()

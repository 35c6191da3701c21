"""`meshlm demo --scenario stall` end to end, short phases (about 90 s): the whole local mesh as
real processes, a replica that stalls mid-stream and then dies, the tenants' traffic through the
caller library. Resumed streams must be the very streams a healthy replica gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshlm.scenarios import stall

# Times real processes against its own baseline or a deadline: not beside another test (-n 2).
pytestmark = pytest.mark.alone


def test_stall_scenario_resumes_every_broken_stream(tmp_path: Path) -> None:
    report = stall._run(mechanism=True, phase_s=15.0, workdir=tmp_path, say=print)
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert report["resumed_streams"] > 0
    # Greedy decoding in a batch may differ from the replay alone (the control group,
    # unresumed_token_mismatches, shows by how much); a resume must add no stream of its own.
    assert report["resumed_unlike_any_uninterrupted"] == 0, report["streams_by_prompt"]
    assert report["streams_lost"] == 0, report["lost_details"]
    assert report["sla"]["availability"] == 100.0
    exiting = {k: v for k, v in report["exiting_replica"].items() if k != "phase_2_s"}
    assert exiting == {"exited": True, "exit_code": 70, "restarted_by_launcher": False}

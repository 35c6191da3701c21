"""`meshlm demo --scenario stall` end to end, short phases (about 90 s): the whole local mesh as
real processes, a replica that stalls mid-stream and then dies, the tenants' traffic through the
caller library. Resumed streams must be the very streams a healthy replica gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshlm.demo.scenarios import stall

# Times real processes against its own baseline or a deadline: not beside another test (-n 2).
pytestmark = pytest.mark.alone


def test_stall_scenario_resumes_every_broken_stream(tmp_path: Path) -> None:
    report = stall._run(mechanism=True, phase_s=15.0, workdir=tmp_path, say=print)
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert report["resumed_streams"] > 0
    # Every stream, resumed or not, is the replay's: greedy decoding gives a prompt the same
    # stream whatever it is batched with and whatever the replica served before.
    assert report["resume_token_mismatches"] == 0, report["streams_by_prompt"]
    assert report["unresumed_token_mismatches"] == 0, report["streams_by_prompt"]
    assert report["streams_lost"] == 0, report["lost_details"]
    assert report["sla"]["availability"] == 100.0
    exiting = {k: v for k, v in report["exiting_replica"].items() if k != "phase_2_s"}
    assert exiting == {"exited": True, "exit_code": 70, "restarted_by_launcher": False}

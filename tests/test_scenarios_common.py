"""What every `meshlm demo --scenario` shares (meshlm/demo/scenario.py): a scenario that
fails half-way still stops its traffic and then every process of its mesh, and its failure is
one line `meshlm demo: ...` with exit 1, not a traceback. The scenarios themselves run on real
processes in tests/test_scenario_*.py; here a stand-in mesh records what was done to it."""

from __future__ import annotations

import json

import pytest

from meshlm.demo.scenario import report_of, running, write_report


class _Mesh:
    def __init__(self, log: list[str], fail_start: bool = False) -> None:
        self.log = log
        self.fail_start = fail_start

    def start(self, say) -> None:
        self.log.append("mesh started")
        if self.fail_start:  # a runtime that never became ready, a port taken
            raise OSError("runtime v1 exited during start")

    def stop(self) -> None:
        self.log.append("mesh stopped")


def test_traffic_then_the_mesh_stop_whatever_happens() -> None:
    log: list[str] = []
    with pytest.raises(RuntimeError, match="sidecar died"), running(_Mesh(log), log.append) as s:
        s.callback(lambda: log.append("traffic stopped"))
        s.callback(lambda: log.append("poison stopped"))
        raise RuntimeError("sidecar died")
    assert log == [
        "mesh started",
        "poison stopped",
        "traffic stopped",
        "mesh stopped",
        "all processes stopped",
    ]
    log.clear()
    with pytest.raises(OSError), running(_Mesh(log, fail_start=True), log.append):
        pytest.fail("the block runs only once the mesh is up")
    assert log == ["mesh started", "mesh stopped", "all processes stopped"]


def test_a_failed_run_is_one_line_and_a_report_is_printed_with_its_path(tmp_path, capsys) -> None:
    def fails() -> dict:
        raise TimeoutError("rollout still Progressing")

    assert report_of("x: what it shows", fails) is None
    out, err = capsys.readouterr()
    assert out == "meshlm demo --scenario x: what it shows\n"
    assert err == "meshlm demo: rollout still Progressing\n"

    report = {"workdir": str(tmp_path), "sla": {"ok": 3}, "timeline": [1, 2]}
    write_report(tmp_path, report)
    assert report_of("x: what it shows", lambda: report, hide=("timeline",)) is report
    out, _ = capsys.readouterr()
    shown = out.split("\n", 1)[1].rsplit("JSON report: ", 1)
    assert json.loads(shown[0]) == {"workdir": str(tmp_path), "sla": {"ok": 3}}
    assert shown[1] == f"{tmp_path}/report.json\n"
    assert json.loads((tmp_path / "report.json").read_text()) == report

"""The admin API's rollout routes (`xds_server.rollout.api.RolloutAPI.handle`): status codes and
replies a CLI user relies on. Decisions run on the fakes of test_rollout_controller.py."""

from __future__ import annotations

from pathlib import Path

from tests.test_rollout_controller import SPEC, FakeControlPlane, FakeGrpcCounts, FakeLatency
from xds_server.rollout.api import RolloutAPI, is_mutation
from xds_server.rollout.controller import RolloutController
from xds_server.rollout.gates.sources import Sources


def make_api(tmp_path: Path, default: dict | None = None):
    cp, src = FakeControlPlane(), FakeGrpcCounts()
    c = RolloutController(
        cp, str(tmp_path / "r.json"), lambda s: Sources(src, FakeLatency()), autorun=False
    )
    return RolloutAPI(c, lambda service: default if service == "llm" else None), c, cp, src


def test_start_status_and_actions_over_the_api_fake_metrics(tmp_path: Path) -> None:
    api, *_ = make_api(tmp_path)
    code, st = api.handle("POST", "/rollouts/llm", dict(SPEC))
    assert code == 201 and st["state"] == "Progressing" and st["weights"]["v2"] == 5
    assert api.handle("POST", "/rollouts/llm", SPEC)[0] == 409  # already running
    code, all_ = api.handle("GET", "/rollouts", None)
    assert code == 200 and list(all_) == ["llm"]
    assert api.handle("POST", "/rollouts/llm/pause", b"")[1]["state"] == "Paused"
    assert api.handle("POST", "/rollouts/llm/resume", b"")[1]["state"] == "Progressing"
    code, st = api.handle("POST", "/rollouts/llm/promote", None)
    assert code == 200 and st["state"] == "Succeeded" and st["stable"] == "v2"
    assert api.handle("GET", "/rollouts/llm", None)[1]["weights"] == {"v1": 0, "v2": 100}
    assert api.handle("POST", "/rollouts/llm/abort", None)[0] == 409  # finished already


def test_api_errors_are_clear_and_change_nothing_fake_metrics(tmp_path: Path) -> None:
    api, c, cp, _ = make_api(tmp_path)
    code, err = api.handle("POST", "/rollouts/llm", b'{"stable": "v1", "canary": "v1"}')
    assert code == 400 and "canary" in err["error"]
    code, err = api.handle("POST", "/rollouts/llm", b"{not json")
    assert code == 400
    code, err = api.handle("POST", "/rollouts/llm", b"")
    assert code == 400 and "rollouts.llm" in err["error"]  # no spec here nor in the mesh file
    assert api.handle("GET", "/rollouts/nope", None)[0] == 404
    assert api.handle("POST", "/rollouts/llm/explode", None)[0] == 404
    assert api.handle("DELETE", "/rollouts/llm", None)[0] == 405
    assert cp.calls == [] and c.status() == {}
    assert is_mutation("POST", "/rollouts/llm/abort") and not is_mutation("GET", "/rollouts")


def test_start_with_empty_body_uses_the_mesh_file_spec_fake_metrics(tmp_path: Path) -> None:
    default = dict(SPEC)
    api, _, cp, _ = make_api(tmp_path, default)
    code, st = api.handle("POST", "/rollouts/llm", None)
    assert code == 201 and st["spec"]["steps"] == [5, 25, 50, 100]
    assert cp.calls == [("llm", {"v1": 95, "v2": 5})]

"""`meshlm demo --scenario bad-model` (issue 18) is wired: its mesh is valid, the quality replay
goes through the demo's caller sidecar as the `replay` tenant whose key the control plane gets,
and the scenario is registered. (The scenario itself runs in minutes: `meshlm demo`.)"""

from __future__ import annotations

import hashlib

from meshlm.launcher import LocalMesh, demo_mesh
from meshlm.scenarios import SCENARIOS, bad_model
from xds_server.mesh import parse_mesh
from xds_server.rollout_api import spec_from_mesh
from xds_server.rollout_spec import parse_rollout


def test_the_bad_model_mesh_replays_through_the_caller_sidecar_as_the_replay_tenant(
    tmp_path,
) -> None:
    mesh = LocalMesh(bad_model.mesh(demo_mesh()), workdir=tmp_path, faults=bad_model.SERVE_ARGS)
    spec = parse_rollout("llm", spec_from_mesh(parse_mesh(mesh.mesh), "llm"))
    assert spec.quality.replay_via == mesh.caller_target
    assert spec.quality.prompts == tuple(bad_model.GOLDEN)
    key_hash = hashlib.sha256(bad_model.REPLAY_KEY.encode()).hexdigest()
    assert mesh.mesh["tenants"]["replay"]["key_sha256"] == key_hash
    assert mesh.serve_args(mesh.runtimes["v2"])[-2:] == ["--group-size", "64"]
    assert "quality" not in demo_mesh()["rollouts"]["llm"]  # the normal demo is unchanged
    assert SCENARIOS["bad-model"] == "meshlm.scenarios.canary"

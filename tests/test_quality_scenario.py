"""The demo's quality gate (issue 18) is wired: `meshlm demo` and `--scenario bad-model` roll out
with a mirror-mode quality gate from the demo mesh (no golden prompts, no replay tenant), the
bad-model canary serves int4 at group 64, and the scenario is registered. (The scenarios
themselves run in minutes: `meshlm demo`, tests/test_demo_e2e.py.)"""

from __future__ import annotations

from meshlm.demo.launcher import LocalMesh
from meshlm.demo.scenario import SCENARIOS
from meshlm.demo.scenarios import bad_model
from xds_server.mesh import parse_mesh
from xds_server.mesh.rollout_spec import parse_rollout
from xds_server.rollout.api import spec_from_mesh


def test_the_demo_and_the_bad_model_roll_out_with_a_mirror_mode_quality_gate(tmp_path) -> None:
    for faults in (None, bad_model.SERVE_ARGS):
        mesh = LocalMesh(workdir=tmp_path, faults=faults)
        spec = parse_rollout("llm", spec_from_mesh(parse_mesh(mesh.mesh), "llm"))
        q = spec.quality
        assert (q.mode, q.prompts, q.replay_via) == ("mirror", (), "")
        assert 0 < q.mirror_percent <= 100 and q.min_samples >= 1
        assert "replay" not in mesh.mesh["tenants"]
    assert mesh.serve_args(mesh.runtimes["v2"])[-2:] == ["--group-size", "64"]
    assert SCENARIOS["bad-model"] == "meshlm.demo.scenarios.canary"

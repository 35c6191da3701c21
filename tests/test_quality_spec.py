"""The rollout spec's `quality` block (issue 18): validated with messages naming the field, a
prompts file read at parse, persisted and read back whole; and the agreement figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xds_server.compose import build_server
from xds_server.mesh import MeshError, parse_mesh
from xds_server.mesh.rollout_spec import RolloutSpecError, parse_rollout
from xds_server.rollout.api import spec_from_mesh
from xds_server.rollout.controller import Rollout
from xds_server.rollout.quality import Sample, agreement, judge, with_quality
from xds_server.rollout.sources import configured_sources
from xds_server.rollout.verdict import FAIL, HALT, PASS, Verdict

BASE = {"stable": "v1", "canary": "v2"}
Q = {"replay_via": "127.0.0.1:15001", "prompts": ["a", "b", "c"], "min_samples": 2}


def spec(**quality):
    return parse_rollout("llm", {**BASE, "quality": {**Q, **quality}})


@pytest.mark.parametrize(
    ("quality", "field"),
    [
        ({"replay_via": "nowhere"}, "quality.replay_via"),
        ({"prompts": []}, "quality.prompts"),
        ({"prompts": ["ok", ""]}, "quality.prompts"),
        ({"prompts_file": "/nonexistent/golden.txt"}, "quality"),  # both given
        ({"min_samples": 4}, "quality.min_samples"),  # more than the 3 prompts
        ({"max_token_disagreement": "150%"}, "quality.max_token_disagreement"),
        ({"max_token_disagreement": "x%"}, "quality.max_token_disagreement"),
        ({"max_logprob_drift": -1}, "quality.max_logprob_drift"),
        ({"max_new_tokens": 0}, "quality.max_new_tokens"),
        ({"mirror_percent": 10}, "quality.mirror_percent"),
        ({"timeout": "soon"}, "quality.timeout"),
    ],
)
def test_a_bad_quality_block_names_its_field(quality, field) -> None:
    with pytest.raises(RolloutSpecError) as e:
        spec(**quality)
    assert str(e.value).startswith(f"rollouts.llm.{field}"), e.value


def test_a_prompts_file_is_read_at_parse_and_the_spec_round_trips(tmp_path: Path) -> None:
    golden = tmp_path / "golden.txt"
    golden.write_text("first prompt\n\n  second prompt  \n")
    q = dict(Q)
    del q["prompts"]
    s = parse_rollout("llm", {**BASE, "quality": {**q, "prompts_file": str(golden)}})
    assert s.quality.prompts == ("first prompt", "second prompt")
    assert s.quality.max_token_disagreement == 0.05
    again = Rollout.from_dict(json.loads(json.dumps(Rollout(spec=s).to_dict())))
    assert again.spec == s
    missing = {**q, "prompts_file": str(tmp_path / "gone.txt")}
    with pytest.raises(RolloutSpecError, match=r"quality\.prompts_file: cannot read"):
        parse_rollout("llm", {**BASE, "quality": missing})


def test_percentages_and_fractions_mean_the_same() -> None:
    assert spec(max_token_disagreement="5%").quality == spec(max_token_disagreement=0.05).quality


def test_agreement_figures() -> None:
    # the stable's own teacher-forced choice differs from its answer at position 3 (a near-tie)
    same = Sample([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 7, 4], [1, 2, 7, 4], [-1.0] * 4, [-1.0] * 4)
    off = Sample([1, 2, 3, 4], [1, 9, 9, 9], [1, 2, 3, 4], [1, 9, 3, 4], [-1.0] * 4, [-2.0] * 4)
    fig = agreement([same, off])
    assert fig == {
        "samples": 2,
        "exact_match_rate": 0.5,
        "first_divergence": 1.0,
        "token_disagreement": 1 / 8,  # one choice, not the three tokens after the divergence
        "logprob_drift": 0.5,
    }
    gate = spec(max_token_disagreement="10%", max_logprob_drift=1.0).quality
    v = judge(gate, fig, [])
    assert v.outcome == FAIL and "token disagreement 12.5% > max 10.0%" in v.reason
    assert judge(spec(max_token_disagreement="20%").quality, fig, []).outcome == PASS
    short = judge(spec(min_samples=3).quality, fig, ["replay-x: UNAVAILABLE: down"])
    assert short.outcome == HALT and "UNAVAILABLE" in short.reason


def test_the_worse_verdict_wins_and_keeps_both_figures() -> None:
    traffic_ok = Verdict(PASS, "gates passed", {"requests": 9})
    traffic_low = Verdict(HALT, "halted: not enough traffic", {"requests": 0})
    bad = Verdict(FAIL, "quality: token disagreement", {"quality": {"samples": 3}})
    good = Verdict(PASS, "quality passed", {"quality": {"samples": 3}})
    assert with_quality(traffic_low, bad).outcome == FAIL
    slow = Verdict(FAIL, "TTFT p99 4200ms > 1500ms", {"requests": 9})
    both_bad = with_quality(slow, bad)  # a rollback names every gate that failed
    assert both_bad.reason == "TTFT p99 4200ms > 1500ms; quality: token disagreement"
    assert with_quality(traffic_low, good).outcome == HALT
    both = with_quality(traffic_ok, good)
    assert both.outcome == PASS and both.measurements == {"requests": 9, "quality": {"samples": 3}}


def _mesh(quality: dict):
    return parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {
                        "v1": {"endpoints": ["127.0.0.1:1"]},
                        "v2": {"endpoints": ["127.0.0.1:2"]},
                    },
                    "route": {"weights": {"v1": 100, "v2": 0}},
                }
            },
            "rollouts": {"llm": {**BASE, "steps": [50, 100], "quality": quality}},
        }
    )


def test_the_mesh_files_rollout_carries_its_quality_block(tmp_path: Path) -> None:
    golden = tmp_path / "golden.txt"
    golden.write_text("one\ntwo\n")
    q = {"replay_via": "127.0.0.1:15001", "prompts_file": str(golden), "min_samples": 2}
    spec_dict = spec_from_mesh(_mesh(q), "llm")
    golden.unlink()  # read once, when the mesh file loaded
    s = parse_rollout("llm", spec_dict)
    assert s.quality.prompts == ("one", "two") and s.quality.min_samples == 2
    with pytest.raises(MeshError, match=r"^rollouts\.llm\.quality\.min_samples: 3 is more"):
        _mesh({"replay_via": "127.0.0.1:15001", "prompts": ["a", "b"], "min_samples": 3})


def test_the_mesh_replays_with_its_routes_canary_header() -> None:
    mesh = parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {
                        "v1": {"endpoints": ["127.0.0.1:1"]},
                        "v2": {"endpoints": ["127.0.0.1:2"]},
                    },
                    "route": {"weights": {"v1": 100, "v2": 0}, "canary_header": "x-pick"},
                }
            },
        }
    )
    src = configured_sources(build_server(mesh))(spec())
    assert src.quality.canary_header == "x-pick"
    assert src.quality.gate.prompts == ("a", "b", "c")

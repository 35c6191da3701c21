"""The quality gate end to end (issue 18) on real parts: the control plane feeds a real caller
Envoy, which routes to real runtimes serving the real model; the replay goes through that Envoy
with `x-canary` pins, the records are joined by request id on the runtimes' metrics ports.

- a canary with the same weights as the stable is promoted, and the replay's calls are not in the
  traffic gates' counts (with no other traffic the interval halts on "not enough traffic");
- a canary re-quantized at group 64 (fast, healthy, every call OK) is rolled back on quality."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from model_runtime.loading.loader import load
from model_runtime.serving.telemetry import MetricsServer
from tests.runtime_fixtures import calls_in_background, serving_runtime
from tests.test_rollout_envoy import caller_mesh, wait_terminal
from xds_server.rollout.controller import RolloutController
from xds_server.rollout.gates.sources import mesh_sources
from xds_server.rollout.quality import ReplaySource

PROMPTS = [
    "What is the capital of France? Answer with one word.",
    "Name three primary colors.",
    "What do bees make?",
    "Which animal says moo?",
]
SPEC = {
    "service": "llm",
    "stable": "v1",
    "canary": "v2",
    "steps": [50, 100],
    "interval": "1s",
    "threshold": 1,
    "gates": {"grpc_success_rate_min": 99.0, "min_requests": 2},
}


@dataclasses.dataclass
class Served:
    port: int  # what caller_mesh routes to
    metrics_url: str


@contextmanager
def serve(loaded) -> Iterator[Served]:
    rt = serving_runtime(loaded)
    try:
        with MetricsServer(rt.telemetry, records=rt.records) as m:
            yield Served(rt.port, f"http://127.0.0.1:{m.port}/metrics.json")
    finally:
        rt.shutdown(grace=2)


@functools.cache
def degraded():
    """The int4 model re-quantized at group 64 (fast, healthy, answers wrong), loaded once per
    test run (~20 s) for this module and tests/test_quality_mirror.py. Not to be modified."""
    return load(precision="int4", group_size=64)


@pytest.fixture(scope="module")
def stable(smollm_int4) -> Iterator[Served]:
    with serve(smollm_int4) as s:
        yield s


def replaying(envoy, target: str, stable: Served, canary: Served):
    """mesh_sources' gates plus the replay through `target` (the caller Envoy)."""
    base = mesh_sources([envoy.admin_url])

    def factory(spec):
        q = dataclasses.replace(spec.quality, replay_via=target)
        replay = ReplaySource(
            q, spec.service, lambda: [stable.metrics_url], lambda: [canary.metrics_url]
        )
        return dataclasses.replace(base(spec), quality=replay)

    return factory


@contextmanager
def traffic(target: str) -> Iterator[None]:
    """Short greedy calls through the caller Envoy until the block ends."""
    say_hi = lambda c: list(c.generate("Say hi.", max_new_tokens=2, timeout=20))  # noqa: E731
    with calls_in_background(target, [say_hi], join_s=30):
        yield


def quality(max_token_disagreement: str) -> dict:
    return {
        "replay_via": "127.0.0.1:1",  # replaced by the test's caller Envoy
        "prompts": PROMPTS,
        "max_new_tokens": 8,
        "min_samples": len(PROMPTS),
        "max_token_disagreement": max_token_disagreement,
    }


def test_a_canary_that_answers_like_the_stable_is_promoted_and_replay_is_not_traffic(
    stable, smollm_int4, tmp_path: Path
) -> None:
    with serve(smollm_int4) as canary, caller_mesh(stable, canary) as (cp, envoy, target):
        c = RolloutController(
            cp, str(tmp_path / "r.json"), replaying(envoy, target, stable, canary), autorun=False
        )
        try:
            c.start({**SPEC, "quality": quality("10%")})
            c.tick("llm", force=True)  # no traffic but the replay's
            first = c.status("llm")["analyses"][0]
            assert first["outcome"] == "halt" and "not enough traffic" in first["reason"]
            assert first["requests"] == 0  # the replay's calls are not counted
            assert first["quality"]["samples"] == len(PROMPTS)
            assert first["quality"]["token_disagreement"] == 0.0
            with traffic(target):
                c.close()
                c = RolloutController(
                    cp, str(tmp_path / "r.json"), replaying(envoy, target, stable, canary),
                    poll_s=0.05,
                )  # fmt: skip
                st = wait_terminal(c, timeout=120)
        finally:
            c.close()
    assert st["state"] == "Succeeded", st["message"]
    passed = [a for a in st["analyses"] if a["outcome"] == "pass"]
    assert passed and all(a["quality"]["exact_match_rate"] == 1.0 for a in passed)


def test_a_fast_healthy_canary_that_answers_differently_is_rolled_back_on_quality(
    stable, tmp_path: Path
) -> None:
    broken = degraded()
    with (
        serve(broken) as canary,
        caller_mesh(stable, canary) as (cp, envoy, target),
        traffic(target),
    ):
        c = RolloutController(
            cp, str(tmp_path / "r.json"), replaying(envoy, target, stable, canary), poll_s=0.05
        )
        try:
            c.start({**SPEC, "quality": quality("10%")})
            st = wait_terminal(c, timeout=120)
        finally:
            c.close()
    assert st["state"] == "RolledBack", st["message"]
    assert "quality: token disagreement" in st["message"]
    last = st["analyses"][-1]
    assert last["outcome"] == "fail"
    assert last["quality"]["token_disagreement"] > 0.1

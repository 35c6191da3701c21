"""The product's main job, end to end on real processes: `meshlm demo` starts the control plane,
two runtimes of the real model (bf16 stable, int4 canary), three sidecar Envoys with the Wasm
authz filter, and tenants' traffic (gRPC, and OpenAI HTTP calls with the openai SDK), then rolls
the canary out gated on measured SLOs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshlm.demo.launcher import MESH_ID_ENV

SPIFFE_LLM = "spiffe://meshlm.local/ns/default/sa/llm"
SPIFFE_CALLER = "spiffe://meshlm.local/ns/default/sa/caller"


def _demo(tmp_path: Path, *flags: str) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "demo", "--workdir", str(tmp_path), *flags],
        capture_output=True,
        text=True,
        timeout=400,
    )
    report = json.loads((tmp_path / "report.json").read_text())
    return proc.returncode, report, proc.stdout + proc.stderr


def _within_step(step: dict, sigmas: float = 4.0) -> bool:
    """The canary's observed share of calls at a step agrees with the step's weight."""
    n = step["canary_requests"] + step["stable_requests"]
    p = step["canary_weight"] / 100
    return abs(step["canary_requests"] - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


def _processes_of(workdir: Path) -> list[str]:
    """Processes (Envoys included) that inherited this demo's mesh id."""
    marker = f"{MESH_ID_ENV}={workdir}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass  # gone, or not ours to read
    return found


@pytest.fixture
def no_leftover_processes(tmp_path: Path) -> Iterator[None]:
    yield
    assert _processes_of(tmp_path) == [], "the demo left processes behind"


def test_demo_promotes_a_healthy_canary(tmp_path: Path, no_leftover_processes: None) -> None:
    rc, report, out = _demo(tmp_path)
    assert rc == 0, out
    rollout, traffic = report["rollout"], report["traffic"]
    assert rollout["state"] == "Succeeded", out
    assert rollout["weights"] == {"v1": 0, "v2": 100} and rollout["stable"] == "v2"
    assert all(_within_step(s) for s in rollout["traffic"]), rollout["traffic"]
    by_tenant = traffic["by_tenant"]
    # No allowed request failed during any weight change.
    assert set(by_tenant["acme"]) == {"OK"} and by_tenant["acme"]["OK"] > 50, by_tenant
    # The rate-limited tenant got 429s, and is not allowed to call Info.
    assert by_tenant["free"]["RESOURCE_EXHAUSTED"] > 0 and by_tenant["free"]["OK"] > 0
    assert by_tenant["free"]["PERMISSION_DENIED"] > 0
    assert set(by_tenant["intruder"]) == {"UNAUTHENTICATED"}
    assert (
        report["denials_at_sidecars"]["denied.unknown_key"]
        == by_tenant["intruder"]["UNAUTHENTICATED"]
    )
    assert "=== meshlm demo report ===" in out
    # The client's TTFT per version that answered (issue 13), beside what each gate read over
    # exactly its interval from the canary runtime.
    by_version = traffic["by_version"]
    assert set(by_version) == {"v1", "v2"}
    assert sum(v["count"] for v in by_version.values()) == traffic["ok"]
    assert [s["step"] for s in report["steps"]] == [a["step"] for a in rollout["analyses"]]
    # A step that passed read the canary's latency over exactly its interval. An interval may
    # also halt (neither promotes nor fails: too few calls, or the runtime's metrics not read in
    # time on a loaded machine); the report then says why, and the step is judged again.
    passed = [s for s in report["steps"] if s["outcome"] == "pass"]
    # (steps [20, 50, 100]: the last is the promotion, not analysed)
    assert [s["canary_weight"] for s in passed] == [20, 50], report["steps"]
    for s in passed:
        assert s["gate_over"] == "interval" and s["gate_samples"] > 0, s
        assert s["client_ttft_ms"]["v2"]["count"] > 0, s
    for s in report["steps"]:
        assert s["outcome"] in ("pass", "halt"), s
        assert s["outcome"] == "pass" or f"    {s['reason']}" in out, s
    assert (tmp_path / "calls.jsonl").read_text().count("\n") == traffic["requests"]
    _assert_openai(traffic, out)
    _assert_identity(report, out, tmp_path)


def _assert_openai(traffic: dict, out: str) -> None:
    """A share of acme's calls went with the openai SDK through the caller sidecar (issue 17):
    all succeeded (acme's OK count above covers them too), both versions answered some (the
    canary took its steps' share), and the report shows them beside the gRPC calls."""
    by_api = traffic["by_api"]
    assert set(by_api) == {"grpc", "openai"}, by_api
    openai_calls = by_api["openai"]
    assert openai_calls["requests"] >= 20 and openai_calls["ok"] == openai_calls["requests"]
    assert set(openai_calls["by_version"]) == {"v1", "v2"}, openai_calls
    assert openai_calls["by_version"]["v2"]["count"] > 0
    assert "  OpenAI HTTP (openai SDK): " in out and "  gRPC: " in out


def _assert_identity(report: dict, out: str, workdir: Path) -> None:
    """Every sidecar holds the SPIFFE ID its join token granted (the service's account for the
    inbound ones), its Envoy presents that certificate, the demo's 30 s certificates were
    renewed while every acme call succeeded, and the caller -> inbound hops ran over mTLS."""
    ident = report["identity"]
    assert ident["enabled"], ident
    cars = ident["sidecars"]
    assert {n: c["spiffe_id"] for n, c in cars.items()} == {
        "sidecar-v1": SPIFFE_LLM,
        "sidecar-v2": SPIFFE_LLM,
        "sidecar-caller": SPIFFE_CALLER,
    }
    assert all(c["renewals"] > 0 and c["in_envoy"] for c in cars.values()), cars
    mesh_hops = {h["to"]: h["mtls"] for h in ident["hops"] if h["kind"] == "mesh"}
    assert mesh_hops == {"sidecar-v1": True, "sidecar-v2": True}, ident["hops"]
    assert "\nidentity: " in out
    # Join tokens only in 0600 files of the work dir; no token or key in the report or logs.
    tokens = sorted((workdir / "join-tokens").iterdir())
    assert [t.name for t in tokens] == ["caller.json", "v1.json", "v2.json"]
    assert all(t.stat().st_mode & 0o777 == 0o600 for t in tokens)
    secrets = [json.loads(t.read_text())["token"] for t in tokens] + ["PRIVATE KEY"]
    texts = [(workdir / "report.json").read_text(), out]
    texts += [p.read_text(errors="replace") for p in workdir.glob("*.log")]
    assert not [s for s in secrets if any(s in t for t in texts)]


def test_demo_rolls_back_a_faulty_canary(tmp_path: Path, no_leftover_processes: None) -> None:
    rc, report, out = _demo(tmp_path, "--faulty-canary")
    assert rc == 0, out
    rollout = report["rollout"]
    assert rollout["state"] == "RolledBack", out
    assert rollout["weights"] == {"v1": 100, "v2": 0}
    threshold = rollout["spec"]["threshold"]
    failed = [a for a in rollout["analyses"] if a["outcome"] == "fail"]
    assert 0 < len(failed) <= threshold
    # Never more traffic than its step: the canary stayed at the first step and its observed
    # share agrees with that step's weight.
    first = rollout["spec"]["steps"][0]
    assert max(a["canary_weight"] for a in rollout["analyses"]) == first
    assert all(_within_step(s) for s in rollout["traffic"]), rollout["traffic"]
    assert set(report["traffic"]["by_tenant"]["acme"]) <= {"OK", "UNAVAILABLE"}

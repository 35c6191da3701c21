"""`meshlm demo --scenario shared-prefix`: its workload keys as it should (each group one prefix
key, the groups apart, the caller's Wasm filter on the wasmtime host computing them), and the
scenario end to end on real processes (control plane, four Envoys, three real model runtimes),
kept short."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshlm.demo.scenario import SCENARIOS
from meshlm.demo.scenarios import shared_prefix
from schemas.codec import ChatMessage, GenerateRequest, encode_generate_request
from wasm_filters.host import CLASSIFY_WASM_PATH, WasmHost


def _key(host: WasmHost, prompt: str) -> str:
    msg = encode_generate_request(GenerateRequest(messages=[ChatMessage("user", prompt)]))
    d = host.request({":authority": "llm"}, body=b"\x00" + len(msg).to_bytes(4, "big") + msg)
    v = d.header("x-meshlm-prefix")
    assert v is not None
    return v.decode()


def test_each_group_is_one_prefix_key_and_the_groups_differ() -> None:
    host = WasmHost(CLASSIFY_WASM_PATH)
    assert host.configure(b"")
    keys = []
    for g in range(shared_prefix.GROUPS):
        mine = {_key(host, p) for p in shared_prefix.prompts(g)}
        assert len(mine) == 1, g
        keys.append(mine.pop())
    assert len(set(keys)) == shared_prefix.GROUPS
    # the questions differ (so the calls are not one prompt repeated)
    assert len(set(shared_prefix.prompts(0))) == shared_prefix.QUESTIONS


@pytest.mark.alone
def test_shared_prefix_prefix_aware_keeps_each_group_on_its_cached_replica(tmp_path: Path) -> None:
    assert SCENARIOS["shared-prefix"] == "meshlm.demo.scenarios.shared_prefix"
    report = shared_prefix._run("prefix_aware", seconds=15.0, workdir=tmp_path, say=print)
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert report["load_balancing"] == "prefix_aware"
    assert report["sla"]["ok"] > 0 and report["sla"]["availability"] == 100.0
    assert set(report["ttft_ms"]) == {"p50", "p90", "p99"}
    assert report["output_tokens_per_s"] > 0
    assert set(report["served_by_replica"]) == {"v1-0", "v1-1", "v1-2"}
    assert sum(report["served_by_replica"].values()) >= report["sla"]["ok"]
    # The counted calls come after one warm-up round (each group once). A policy blind to the
    # prefix sends a group's next call to the replica holding its document at best 1 time in 3
    # (least_loaded, random) or never (round robin: 13 groups over 3 replicas), so its hit ratio
    # is about 1/3 of the document's share of the prompt (~0.97) at most. With the prefix key each
    # group goes back to its replica, spilling only past the bounded load.
    assert report["prefix_cache_hit_ratio"] >= 0.6, report
    assert len(report["replicas_per_group"]) == shared_prefix.GROUPS

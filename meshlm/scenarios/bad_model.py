"""`meshlm demo --scenario bad-model` (issue 18): the canary is the int4 model re-quantized at group
64 (`meshlm serve --group-size 64`; perplexity +50 %, degenerate greedy answers) - as fast and
healthy as the good int4 by every latency and error metric. The rollout carries a quality gate:
each interval the control plane replays a golden prompt set through the caller sidecar to both
versions (`x-canary: never|always`, as the `replay` tenant, whose key it reads from
MESHLM_REPLAY_KEY) and compares the answers; the canary is rolled back on quality alone, and
report.json shows the agreement per step (`quality_per_step`). The canary scenario's flow
(meshlm/scenarios/canary.py) runs it.

Thresholds, from `python -m bench quality` (bf16 stable, 16 prompts x 16 tokens): int4 g32
disagrees on ~3 % of positions with a drift of ~0.01 nats/token, g64 on ~25 % with ~0.4; the gate
below (10 %, 0.1) sits between them.
"""

from __future__ import annotations

import copy
from typing import Any

REPLAY_KEY_ENV = "MESHLM_REPLAY_KEY"
REPLAY_KEY = "demo-replay-key"  # the demo's own; only its SHA-256 is in the mesh
SERVE_ARGS = {"v2": ["--group-size", "64"]}
GOLDEN = [
    "What is the capital of France? Answer with one word.",
    "Name three primary colors.",
    "What do bees make?",
    "What is the opposite of hot?",
    "How many days are in a week?",
    "Which animal says moo?",
    "What is the largest ocean on Earth?",
    "Translate 'good morning' into French.",
]


def mesh(base: dict[str, Any]) -> dict[str, Any]:
    """The demo mesh plus a `replay` tenant (its own rate limit: the replay never spends a
    customer's) and the rollout's quality block (LocalMesh fills in replay_via)."""
    m = copy.deepcopy(base)
    m["tenants"]["replay"] = {
        "key_sha256": "5601a3ab51a3f2a5e9595fd958d880dccb08e65805397f08323d5f9c9efd5857",
        "allow": ["llm/Generate"],
        "rate_limit": {"max_tokens": 32, "tokens_per_fill": 16, "fill_interval": "1s"},
        "priority": "normal",
    }
    m["rollouts"]["llm"]["quality"] = {
        "replay_via": "127.0.0.1:1",
        "api_key_env": REPLAY_KEY_ENV,
        "prompts": list(GOLDEN),
        "max_new_tokens": 8,
        "min_samples": len(GOLDEN),
        "max_token_disagreement": "10%",
        "max_logprob_drift": 0.1,
        "timeout": "60s",
    }
    return m


def quality_per_step(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Each analysis interval's quality figures beside its outcome."""
    return [
        {"step": a["step"], "canary_weight": a["canary_weight"], "outcome": a["outcome"],
         **a.get("quality", {})}
        for a in status.get("analyses", [])
    ]  # fmt: skip

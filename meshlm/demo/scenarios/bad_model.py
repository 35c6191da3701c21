"""`meshlm demo --scenario bad-model`: the canary is the int4 model re-quantized at group
64 (`meshlm serve --group-size 64`: a worse perplexity, degenerate greedy answers) - as fast and
healthy as the good int4 by every latency and error metric. The demo's rollout carries the quality
gate in mirror mode (meshlm/demo/mesh.yaml): while a step runs, the caller sidecar copies half of
the tenants' greedy calls to the canary, the control plane joins each copy's answer with the
stable's by request id and compares them; the canary is rolled back on quality alone, and
report.json shows the agreement per step (`quality_per_step`). The canary scenario's flow
(meshlm/demo/scenarios/canary.py) runs it.

Thresholds: the demo's gate bounds the logprob drift between what `python -m bench quality`
finds for a sound int4 g32 canary and for g64 (BENCHMARKS.md); over a few mirrored calls of the
demo's five prompts the share of differing tokens is noisy, so its bound (40 %) is loose.
"""

from __future__ import annotations

from typing import Any

SERVE_ARGS = {"v2": ["--group-size", "64"]}


def quality_per_step(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Each analysis interval's quality figures beside its outcome."""
    return [
        {"step": a["step"], "canary_weight": a["canary_weight"], "outcome": a["outcome"],
         **a.get("quality", {})}
        for a in status.get("analyses", [])
    ]  # fmt: skip

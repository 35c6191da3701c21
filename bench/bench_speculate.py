"""Speculative decoding by prompt lookup: Engine tokens/s with and without, on prompts that repeat
given text (drafts hit) and on chat prompts (they rarely do), int4, one stream and 4 concurrent,
interleaved rounds in one process; the acceptance rate; whether the outputs are the same tokens.

`python -m bench speculate` (add --quick for a smoke run).
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch

from bench.machine import describe
from model_runtime.engine.engine import Engine, GenerateParams
from model_runtime.loading.loader import load

_PARA = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every "
    "night its keeper climbed the narrow stairs, lit the great lamp, and watched the ships pass "
    "safely through the dark water below. When the storms came, the light never failed, and the "
    "sailors of the village told their children that the lighthouse was alive."
)
PROMPTS = {
    "repeat": [
        f"Repeat the following text exactly, word for word:\n\n{_PARA}",
        f"Here is a paragraph:\n\n{_PARA}\n\nCopy it out again, then count its sentences.",
        "Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, "
        "kiwi, lemon, mango, nectarine, orange, papaya.",
        "Rewrite this code with comments:\n\ndef add(a, b):\n    total = a + b\n    return total"
        "\n\ndef mul(a, b):\n    total = a * b\n    return total\n",
    ],
    "chat": [
        "Write a long story about a dragon and a knight.",
        "Explain how a bicycle works.",
        "What are the benefits of regular exercise?",
        "Describe the water cycle in detail.",
    ],
}
K = 8  # the most drafts per step in the "on" runs


def _run(lm, prompts: list[str], k: int, max_new: int) -> dict:
    """All `prompts` submitted at once to a fresh engine (no prefix cache from another run)."""
    engine = Engine(lm, max_batch=len(prompts), speculate_lookup=k)
    engine.start()
    outs: list[list[int]] = [[] for _ in prompts]
    done = threading.Semaphore(0)
    t, cpu = time.perf_counter(), time.process_time()
    try:
        for i, text in enumerate(prompts):
            ids = lm.tokenizer.encode_chat([{"role": "user", "content": text}])

            def on_event(ev, out=outs[i]):
                out.extend(ev.token_ids)
                if ev.finish_reason is not None:
                    done.release()

            engine.submit(f"s{i}", GenerateParams(ids, max_new_tokens=max_new), on_event)
        for _ in prompts:
            done.acquire()
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
        st = engine.stats()
    finally:
        engine.shutdown(drain_timeout=5)
    n = sum(map(len, outs))
    return {
        "outs": outs,
        "tps": n / wall,
        "cpu_ms": 1000 * cpu / n,
        "drafted": st["draft_tokens"],
        "accepted": st["draft_accepted"],
    }


def main(quick: bool) -> str:
    load0 = os.getloadavg()
    rounds, max_new = (1, 32) if quick else (3, 128)
    lm = load(precision="int4", nonfinite_guard=False)
    cases = [(kind, b) for kind in PROMPTS for b in (1, 4)]
    res: dict[tuple, list[dict]] = {}
    _run(lm, PROMPTS["chat"][:1], K, 4)  # warm up
    for _ in range(rounds):  # off, on, off, on, ... per case, interleaved
        for kind, b in cases:
            for k in (0, K):
                res.setdefault((kind, b, k), []).append(_run(lm, PROMPTS[kind][:b], k, max_new))
    load1 = os.getloadavg()
    lines = [
        "## Speculative decoding by prompt lookup (Engine, int4)",
        "",
        f"Machine: {describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads.",
        f"Command: `python -m bench speculate{' --quick' if quick else ''}`. {rounds} interleaved "
        f"rounds (off, on, ...) of up to {max_new} greedy tokens per stream, a fresh Engine per "
        f"run; `on` = `speculate_lookup={K}`. Load average {load0[0]:.1f} at start, "
        f"{load1[0]:.1f} at the end. Medians over rounds; CPU ms = process CPU time per token.",
        "",
        "| prompts | streams | tok/s off | tok/s on | on/off | CPU ms/token off | on | "
        "drafts accepted | tokens/step/stream | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, b in cases:
        off, on = res[(kind, b, 0)], res[(kind, b, K)]
        t_off = statistics.median(r["tps"] for r in off)
        t_on = statistics.median(r["tps"] for r in on)
        c_off = statistics.median(r["cpu_ms"] for r in off)
        c_on = statistics.median(r["cpu_ms"] for r in on)
        drafted = sum(r["drafted"] for r in on)
        acc = sum(r["accepted"] for r in on)
        toks = sum(len(o) for r in on for o in r["outs"])
        steps = (toks - acc) / b  # each step emits one token per stream plus the accepted drafts
        same = sum(a["outs"] == z["outs"] for a, z in zip(off, on, strict=True))
        lines.append(
            f"| {kind} | {b} | {t_off:.1f} | {t_on:.1f} | {t_on / t_off:.2f}x | {c_off:.1f} | "
            f"{c_on:.1f} | {acc}/{drafted} ({100 * acc / max(1, drafted):.0f} %) | "
            f"{toks / b / max(1, steps):.2f} | {same}/{len(on)} rounds |"
        )
    lines += [
        "",
        "`same tokens`: runs whose outputs equal the run without speculation token for token. "
        "Draft rows are decode rows of the same batched forward; where they differ, the "
        "attention's padded length changed bf16 rounding at a near-tie (as batching does).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(main(quick=False))

"""Agreement with bf16 (issue 18, item 5): what the rollout's quality gate would measure for an
int4 canary (exact Q4_1 remap, group 32), the same on int8 activations, and a degraded one
(re-quantized at group 64), on a fixed golden prompt set, beside each model's perplexity. The
figures are xds_server.rollout.quality's (`agreement`, the gate's own code), the stable being bf16;
greedy answers come from model_runtime.engine.generate.greedy, the scores from
model_runtime.serving.records.teacher_forced (what a runtime's GET /score runs).

`python -m bench quality` (add --quick for a smoke run).
"""

from __future__ import annotations

import os
import time

from bench.machine import describe
from model_runtime.engine.generate import greedy
from model_runtime.engine.perplexity import perplexity, stdlib_text
from model_runtime.loading.loader import load
from model_runtime.serving.records import teacher_forced
from xds_server.rollout.quality import Sample, agreement

GOLDEN = [
    "What is the capital of France? Answer with one word.",
    "Name three primary colors.",
    "What is 12 plus 7?",
    "Write one sentence about the sea.",
    "What do bees make?",
    "Translate 'good morning' into French.",
    "What is the opposite of hot?",
    "Give a synonym for happy.",
    "How many days are in a week?",
    "What gas do plants take in?",
    "Name a planet in our solar system.",
    "What is water made of?",
    "Complete: The quick brown fox",
    "Which animal says moo?",
    "What is the largest ocean on Earth?",
    "Describe a cat in five words.",
]
CANARIES = {
    "int4 (g32)": {},
    "int4, int8 activations": {"activations": "int8"},
    "int4 g64 (broken)": {"group_size": 64},
}


def main(quick: bool) -> str:
    load0 = os.getloadavg()
    n_new, prompts = (8, GOLDEN[:4]) if quick else (16, GOLDEN)
    win, n_win = (256, 1) if quick else (512, 2)
    t0 = time.monotonic()
    stable = load(precision="bf16")
    ids = [stable.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    text_ids = stable.tokenizer.encode(stdlib_text())
    answers = greedy(stable, ids, n_new)
    kept = [i for i, a in enumerate(answers) if a]  # an empty answer has nothing to score
    own = {i: teacher_forced(stable.model, ids[i], answers[i]) for i in kept}
    rows = [("bf16 (stable)", None, perplexity(stable.model, text_ids, win, n_win))]
    for name, kw in CANARIES.items():
        lm = load(precision="int4", **kw)
        got = greedy(lm, ids, n_new)
        samples = []
        for i in kept:
            c, s = teacher_forced(lm.model, ids[i], answers[i]), own[i]
            samples.append(
                Sample(answers[i], got[i], s["argmax"], c["argmax"], s["logprobs"], c["logprobs"])
            )
        rows.append((name, agreement(samples), perplexity(lm.model, text_ids, win, n_win)))
    load1 = os.getloadavg()
    out = [
        "## Quality gate: agreement with bf16 (issue 18)",
        "",
        f"{describe()}. `python -m bench quality{' --quick' if quick else ''}`: "
        f"{len(prompts)} golden prompts (bench/bench_quality.py GOLDEN), {n_new} greedy tokens "
        f"each from bf16; the canary's figures as the rollout's quality gate computes them "
        f"(xds_server/rollout/quality.py). Perplexity: {n_win}x{win} tokens of "
        f"pydoc_data/topics.py. "
        f"Load average {load0[0]:.1f} at start, {load1[0]:.1f} at end; "
        f"{time.monotonic() - t0:.0f} s.",
        "",
        "| model | exact match | first divergence | token disagreement | logprob drift "
        "(nats/token) | perplexity |",
        "|---|---|---|---|---|---|",
    ]
    for name, fig, ppl in rows:
        if fig is None:
            out.append(f"| {name} | - | - | - | - | {ppl:.2f} |")
            continue
        first = "-" if fig["first_divergence"] is None else f"{fig['first_divergence']:.1f}"
        out.append(
            f"| {name} | {fig['exact_match_rate']:.0%} | {first} | "
            f"{fig['token_disagreement']:.1%} | {fig['logprob_drift']:.3f} | {ppl:.2f} |"
        )
    out += [
        "",
        "Token disagreement: the share of the bf16 answer's positions where the canary's "
        "teacher-forced choice differs from bf16's; first divergence: the mean position of the "
        "first differing token over answers that differ. A quality block of "
        "max_token_disagreement 10 % and max_logprob_drift 0.1 passes the int4 canaries (int4 "
        "with int8 activations too: `meshlm serve --activations int8`) and fails the broken one.",
    ]
    return "\n".join(out)

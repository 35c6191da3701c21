"""A bounded before/after check of stall-free batching on the Engine (no HTTP): `c` streams,
each a closed loop of unique ~150-token chat prompts and 64 greedy tokens, with the mixed step on
and off (Engine(mixed_step=...)), the two interleaved round by round so a shared machine's drift
hits both. Reports inter-token p50 and p99 (gaps between a stream's token events), output
tok/s and their ratios. Not a bench area (no BENCHMARKS.md section): `python -m bench.mixed_step
[--precision int4|bf16] [--rounds 2] [--calls 2]`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

from model_runtime.engine.engine import Engine, GenerateParams
from model_runtime.loading.loader import load

WORDS = [
    "river",
    "mountain",
    "lantern",
    "copper",
    "violet",
    "engine",
    "harbor",
    "meadow",
    "signal",
    "orbit",
    "canyon",
    "ember",
    "glacier",
    "pepper",
    "velvet",
    "falcon",
    "marble",
    "thunder",
    "willow",
    "compass",
    "saddle",
    "beacon",
    "quartz",
    "tundra",
]


def _prompt(tok, rng: random.Random) -> list[int]:
    words = " ".join(rng.choice(WORDS) for _ in range(120))
    text = f"Here is a list of words: {words}. Write a short story that uses some of them."
    return tok.encode_chat([{"role": "user", "content": text}])


def _run(lm, conc: int, calls: int, mixed: bool, seed: int) -> tuple[float, float, float]:
    """(inter-token p50 and p99 in ms, output tok/s) of `conc` closed-loop streams."""
    e = Engine(lm, max_batch=8, max_queue=64, mixed_step=mixed)  # on: forced
    e.start()
    gaps: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def worker(w: int) -> None:
        rng = random.Random(seed * 1000 + w)
        for i in range(calls):
            done, last = threading.Event(), [None]

            def on_event(ev, done=done, last=last) -> None:
                now = time.monotonic()
                if ev.token_ids:
                    with lock:
                        if last[0] is not None:
                            gaps.append(now - last[0])
                        tokens[0] += len(ev.token_ids)
                    last[0] = now
                if ev.finish_reason is not None:
                    done.set()

            p = GenerateParams(prompt_ids=_prompt(lm.tokenizer, rng), max_new_tokens=64)
            e.submit(f"w{w}-{i}-{seed}", p, on_event)
            if not done.wait(300):
                raise TimeoutError("a call did not finish in 300 s")

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    e.shutdown()
    q = statistics.quantiles(gaps, n=100)
    return q[49] * 1e3, q[98] * 1e3, tokens[0] / wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="int4", choices=("int4", "bf16"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2, help="calls per stream")
    ap.add_argument("--conc", default="1,4,8")
    a = ap.parse_args()
    lm = load(precision=a.precision)
    rows = {}
    for r in range(a.rounds):
        for conc in map(int, a.conc.split(",")):
            for mixed in (False, True):  # the same prompts (seed r) on both sides
                rows.setdefault((conc, mixed), []).append(_run(lm, conc, a.calls, mixed, r))
    print(f"{a.precision}, {a.rounds} rounds x {a.calls} calls a stream, medians over rounds")
    print(
        "conc | ITL p50 off / on ms | ITL p99 off / on ms | tok/s off / on"
        " | on/off: p50, p99, tok/s"
    )
    for conc in map(int, a.conc.split(",")):
        off = [statistics.median(x) for x in zip(*rows[(conc, False)], strict=True)]
        on = [statistics.median(x) for x in zip(*rows[(conc, True)], strict=True)]
        print(
            f"{conc} | {off[0]:.1f} / {on[0]:.1f} | {off[1]:.0f} / {on[1]:.0f} | "
            f"{off[2]:.0f} / {on[2]:.0f} | "
            + ", ".join(f"{b / a:.2f}" for a, b in zip(off, on, strict=True))
        )


if __name__ == "__main__":
    main()

"""Runtime benchmark: decode speed, weight memory and perplexity of int4 / bf16 / fp32, latency
under Poisson load with continuous vs static batching, and llama.cpp on the same GGUF as the peer.

`python -m bench runtime` (add --quick for a smoke run).
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import threading
import time

import torch

from bench.machine import describe
from model_runtime import generate
from model_runtime.engine import Engine, GenerateParams
from model_runtime.gguf_loader import default_gguf_path
from model_runtime.loader import load
from model_runtime.perplexity import perplexity, stdlib_text

STORY = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]


def _decode_tps(lm, batch: int, n: int, repeats: int = 3) -> float:
    """Decode tokens/s of the whole batch: batch / median decode-step time, best of `repeats`
    runs (the median and the best run keep a shared machine's stalls out; no prefill)."""
    ids = lm.tokenizer.encode_chat(STORY)
    generate.greedy(lm, [ids] * batch, 3, stop=False)  # warm up
    best = 0.0
    for _ in range(repeats):
        steps: list[float] = []
        generate.greedy(lm, [ids] * batch, n, stop=False, step_times=steps)
        best = max(best, batch / _pct(steps, 50))
    return best


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def _poisson_load(lm, rate: float, n_req: int, static: bool, max_new: int) -> dict:
    """n_req chat requests arriving as a Poisson process of `rate`/s; TTFT and TPOT per request."""
    engine = Engine(lm, max_batch=8, static_batching=static, max_queue=n_req)
    engine.start()
    rng = random.Random(1)
    topics = ["a dragon", "the sea", "a robot", "Paris", "winter", "a library", "bees", "time"]
    done = threading.Semaphore(0)
    rows: list[dict] = []
    try:
        for i in range(n_req):
            ids = lm.tokenizer.encode_chat(
                [{"role": "user", "content": f"Tell me about {topics[i % 8]}."}]
            )
            row = {"sent": time.monotonic(), "times": []}
            rows.append(row)

            def on_event(ev, row=row):
                if ev.token_ids:
                    row["times"].append(time.monotonic())
                if ev.finish_reason is not None:
                    done.release()

            engine.submit(f"b{i}", GenerateParams(ids, max_new_tokens=max_new), on_event)
            time.sleep(rng.expovariate(rate))
        for _ in rows:
            done.acquire(timeout=600)
    finally:
        engine.shutdown(drain_timeout=5)
    ttft = [r["times"][0] - r["sent"] for r in rows if r["times"]]
    tpot = [
        (r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1)
        for r in rows
        if len(r["times"]) > 1
    ]
    return {
        "ttft50": _pct(ttft, 50),
        "ttft99": _pct(ttft, 99),
        "tpot50": _pct(tpot, 50),
        "tpot99": _pct(tpot, 99),
    }


_PEER = """
import sys, time
from llama_cpp import Llama
path, n, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(path, n_ctx=1024, n_threads=threads, verbose=False)
prompt = ("<|im_start|>user\\nWrite a long story about a dragon and a knight.<|im_end|>\\n"
          "<|im_start|>assistant\\n")
llm(prompt, max_tokens=4)
t = time.perf_counter()
out = llm(prompt, max_tokens=n, temperature=0.0)
print(out["usage"]["completion_tokens"] / (time.perf_counter() - t))
"""


def _llama_cpp(quick: bool) -> str:
    """The peer runs in a child process: a llama.cpp build for another CPU dies of SIGILL."""
    if importlib.util.find_spec("llama_cpp") is None:
        return (
            "llama.cpp peer: **not installed** (`pip install -e '.[bench-peer]'` builds "
            "llama-cpp-python from source, many minutes on 2 cores). Recorded on this kind of "
            "machine earlier (DESIGN.md): ~115 tokens/s at batch 1, perplexity 10.37 (6x512)."
        )
    args = [str(default_gguf_path()), "32" if quick else "128", str(torch.get_num_threads())]
    try:
        p = subprocess.run(
            [sys.executable, "-c", _PEER, *args], capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired:
        return "llama.cpp peer: timed out after 600 s"
    if p.returncode != 0:
        why = f"signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
        return (
            f"llama.cpp peer: llama-cpp-python is installed but crashed ({why}; SIGILL = built "
            "for instructions this CPU lacks). Recorded on this kind of machine earlier "
            "(DESIGN.md): ~115 tokens/s at batch 1, perplexity 10.37 (6x512)."
        )
    tps = float(p.stdout.strip().splitlines()[-1])
    return (
        f"llama.cpp peer (llama-cpp-python, same GGUF, same threads): {tps:.1f} tokens/s at batch 1"
    )


def main(quick: bool) -> str:
    load0 = os.getloadavg()
    n_dec = 16 if quick else 64
    win, n_win = (256, 1) if quick else (512, 6)
    lines = [
        "## Model runtime (SmolLM2-135M-Instruct)",
        "",
        f"Machine: {describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads.",
        f"Command: `python -m bench runtime{' --quick' if quick else ''}`.",
        f"Load average at start {load0[0]:.1f} (on a busy machine absolute speeds drop; the "
        "ratios are measured in one run).",
        "",
        "| precision | weights MiB | decode tok/s batch 1 | decode tok/s batch 8 (total) | "
        f"perplexity ({n_win}x{win} tokens, pydoc_data/topics.py) |",
        "|---|---|---|---|---|",
    ]
    text = stdlib_text()
    results = {}
    for prec in ("int4", "bf16", "fp32"):
        lm = load(precision=prec, nonfinite_guard=False)
        ids = lm.tokenizer.encode(text)
        b1, b8 = _decode_tps(lm, 1, n_dec), _decode_tps(lm, 8, n_dec)
        ppl = perplexity(lm.model, ids, win, n_win)
        results[prec] = (lm.info.weight_bytes / 2**20, b1, b8, ppl)
        lines.append(f"| {prec} | {results[prec][0]:.0f} | {b1:.1f} | {b8:.1f} | {ppl:.3f} |")
        del lm
    i4, b16 = results["int4"], results["bf16"]
    lines += [
        "",
        f"int4 vs bf16: {b16[0] / i4[0]:.2f}x less weight memory, {i4[1] / b16[1]:.2f}x decode "
        f"speed at batch 1, {i4[2] / b16[2]:.2f}x at batch 8, perplexity "
        f"{100 * (i4[3] / b16[3] - 1):+.2f} %. int4 = exact Q4_1 -> int4pack g32 remap of every "
        "layer, output head int8 per channel (an int4 g32 head costs ~+7 % perplexity).",
        "",
        _llama_cpp(quick),
        "",
    ]
    lm = load(precision="int4")
    guard, on, off = lm.model.guard, 0.0, 0.0
    for _ in range(2):  # interleaved, so drift in machine load hits both alike
        lm.model.guard = guard
        on = max(on, _decode_tps(lm, 1, n_dec, repeats=1))
        lm.model.guard = None
        off = max(off, _decode_tps(lm, 1, n_dec, repeats=1))
    lm.model.guard = guard
    lines += [
        f"Non-finite guard (int4, batch 1): on {on:.1f} tok/s, off {off:.1f} tok/s (it checks "
        "the final hidden state once per step and re-runs layer by layer only on inf/nan).",
        "torch.compile (inductor, CPU) was tried on the decode step: ~90 s to compile on this "
        "machine and slower than eager (complex RoPE falls back), so it is not used.",
        "",
    ]
    rates = (0.5, 2.0) if quick else (0.5, 1.5, 4.0)
    n_req, max_new = (6, 16) if quick else (24, 48)
    lines += [
        f"Poisson load, int4, max_batch 8, {n_req} chat requests of {max_new} new tokens per "
        "rate (TTFT from submit; TPOT = mean gap between a request's tokens):",
        "",
        "| req/s | batching | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for rate in rates:
        for static in (False, True):
            r = _poisson_load(lm, rate, n_req, static, max_new)
            lines.append(
                f"| {rate} | {'static' if static else 'continuous'} | {1000 * r['ttft50']:.0f} | "
                f"{1000 * r['ttft99']:.0f} | {1000 * r['tpot50']:.0f} | {1000 * r['tpot99']:.0f} |"
            )
    lines += ["", f"Load average at end {os.getloadavg()[0]:.1f}.", ""]
    return "\n".join(lines)

"""Runtime benchmark: decode and prefill speed of our runtime beside llama.cpp on the same GGUF,
measured the same way (issue 13, item 1), weight memory and perplexity of int4 / bf16 / fp32,
and latency under Poisson load with continuous vs static batching.

Decode: the same chat prompt, prefilled (not timed), then N greedy tokens; the figure is the
decode steps (N - 1 forwards) over the wall time of all of them, per round. Ours: the bare
forward (`generate.greedy`) and the full Engine path (submit -> token events on a queue, as the
gRPC service consumes them). llama.cpp: llama-cpp-python's low-level `eval` + argmax, in a child
process kept alive across rounds (bench/llama_peer.py). Prefill: one prompt of P tokens from
pydoc_data/topics.py into an empty cache, a new slice of the text each round (the Engine's prefix
cache would otherwise serve it). Rounds interleave every variant (ours, llama.cpp, ours, ...), so
drift in a shared machine's load hits all alike; figures are medians over the rounds.

`python -m bench runtime` (add --quick for a smoke run: fewer tokens, one round). The section is
kept per CPU kind (BY_CPU_KIND): a run on an AVX2 CPU does not replace an AVX-512 one's figures.
"""

from __future__ import annotations

import os
import queue
import random
import statistics
import threading
import time

import torch

from bench.llama_peer import LlamaPeer, PeerError, installed
from bench.machine import describe, describe_flags
from model_runtime.engine import generate
from model_runtime.engine.engine import Engine, GenerateParams
from model_runtime.engine.omp import own_thread
from model_runtime.engine.perplexity import decode_perplexity, perplexity, stdlib_text
from model_runtime.kernels import isas, qmm
from model_runtime.llm import native_attention, native_step
from model_runtime.loading.gguf_loader import default_gguf_path
from model_runtime.loading.loader import load

BY_CPU_KIND = True  # bench/__main__.py: one section per CPU kind
STORY = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]
SPECULATE_K = 4  # draft tokens per step when the Engine speculates by prompt lookup
GOALS = {  # issue 13's goals: ratio -> the least it should be
    "int4 decode b1, bare / llama.cpp": 1.2,
    "int4 prefill, bare / llama.cpp": 1.0,
    "int4 decode, b8 / b1 aggregate": 5.0,
    "bf16 decode, b8 / b1 aggregate": 5.0,
    "int4 decode b1, Engine / bare": 0.9,
}


def _bare_decode(lm, ids: list[int], n: int, batch: int) -> tuple[float, list[int]]:
    """Aggregate decode tokens/s of `batch` copies of the prompt over all n - 1 decode steps
    (generate.greedy times each step: forward, argmax, the ids back to Python)."""
    steps: list[float] = []
    out = generate.greedy(lm, [ids] * batch, n, stop=False, step_times=steps)
    return batch * len(steps) / sum(steps), out[0]


def _bare_prefill(lm, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    generate.greedy(lm, [prompt], 1, stop=False)  # prefill + the first token's argmax
    return len(prompt) / (time.perf_counter() - t0)


def _engine_call(engine: Engine, ids: list[int], n: int, **params) -> dict:
    """One request through the Engine, events consumed on this thread as service.py does."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    rid = f"bench-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.submit(rid, GenerateParams(ids, max_new_tokens=n, **params), events.put)
    stamps: list[tuple[float, int]] = []
    tokens: list[int] = []
    while True:
        ev = events.get(timeout=600)
        if ev.token_ids:
            stamps.append((time.perf_counter(), len(ev.token_ids)))
            tokens += ev.token_ids
        if ev.finish_reason is not None:
            if ev.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"engine: {ev.finish_reason}: {ev.error}")
            break
    decode_s = stamps[-1][0] - stamps[0][0]
    return {
        "ttft": stamps[0][0] - t0,
        "decode_tps": (len(tokens) - stamps[0][1]) / decode_s if decode_s else 0.0,
        "tokens": tokens,
    }


def _first_difference(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"differ from token {i + 1} on"
    return "identical" if len(a) == len(b) else f"agree on the first {min(len(a), len(b))}"


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


def _step_rounds(int4, ids: list[int], n: int, add) -> None:
    """The native decode step (native_step.py) and torch's ops in turn on the same model, each
    b1 (tokens/s and CPU seconds of this process per token) and b8."""
    if native_step.why_not(int4.model) is not None:
        return
    for name, on in (("native step", True), ("torch step", False)):
        native_step.use(int4.model, on)
        try:
            cpu0 = time.process_time()
            tps, toks = _bare_decode(int4, ids, n, 1)
            add(f"cpu ms/token int4 {name}", 1000 * (time.process_time() - cpu0) / n)
            add(f"int4 {name} b1", tps)
            add(f"tokens int4 {name}", toks)
            add(f"int4 {name} b8", _bare_decode(int4, ids, n, 8)[0])
        finally:
            native_step.use(int4.model, True)


def _with_engine(lm, fn, **engine_args):
    """`fn(engine)` on a fresh Engine over `lm` (warmed by one short call), shut down after: its
    thread, and the OpenMP pool of that thread, end with it, so that no measurement runs beside
    another thread's pool (model_runtime/engine/omp.py: two pools on 2 cores halve decode speed)."""
    engine = Engine(lm, **engine_args)
    engine.start()
    try:
        _engine_call(engine, lm.tokenizer.encode_chat(STORY), 4)
        return fn(engine)
    finally:
        engine.shutdown(drain_timeout=5)


def _speed_rounds(models: dict, peer: LlamaPeer | None, n: int, p_len: int, rounds: int):
    """Every variant once per round, in a fixed interleaved order. Returns name -> figures. Our
    bare forwards run on a thread of their own, the Engine's on its own thread, one at a time."""
    int4, bf16 = models["int4"], models["bf16"]
    ids = int4.tokenizer.encode_chat(STORY)
    text_ids = int4.tokenizer.encode(stdlib_text())
    r: dict[str, list] = {}
    drafts = [0, 0]

    def add(name: str, value) -> None:
        r.setdefault(name, []).append(value)

    def bare(lm, batch: int) -> tuple[float, list[int]]:
        return own_thread(_bare_decode, lm, ids, n, batch)

    def lookup(engine: Engine) -> dict:
        e = _engine_call(engine, ids, n)
        st = engine.stats()
        drafts[0] += st["draft_accepted"]
        drafts[1] += st["draft_tokens"]
        return e

    def bare_b1() -> None:
        tps, toks = bare(int4, 1)
        add("int4 bare b1", tps)
        add("tokens int4 bare", toks)

    def engine_b1() -> None:
        e = _with_engine(int4, lambda engine: _engine_call(engine, ids, n))
        add("int4 Engine b1", e["decode_tps"])
        add("tokens int4 Engine", e["tokens"])

    # Warm-up, not recorded: first-call allocations, the peer's first decode.
    for lm in (int4, bf16):
        own_thread(generate.greedy, lm, [ids] * 8, 4, stop=False)
    if peer is not None:
        peer.decode(ids, 4)
        peer.decode_batch(ids, 4, 8)
    for i in range(rounds):
        prompt = text_ids[(i + 1) * p_len : (i + 2) * p_len]  # a fresh slice per round
        # the Engine right beside the bare forward, first in every other round: their ratio is
        # taken within a round, and the machine's speed drifts over seconds. A short decode
        # first, not recorded: whichever came first after the round before (a bf16 prefill)
        # read ~25 % slow (AMD Zen 5: 277-299 vs ~400 tok/s for the same step later in the round)
        own_thread(_bare_decode, int4, ids, 16, 1)
        pair = (bare_b1, engine_b1) if i % 2 == 0 else (engine_b1, bare_b1)
        for measure in pair:
            measure()
        if peer is not None:
            seconds, toks = peer.decode(ids, n)
            add("llama.cpp b1", (n - 1) / seconds)
            add("tokens llama.cpp", toks)
            seconds, toks = peer.decode_batch(ids, n, 8)
            add("llama.cpp b8", 8 * (n - 1) / seconds)
            add("tokens llama.cpp b8", toks)
        e = _with_engine(int4, lookup, speculate_lookup=SPECULATE_K)
        add("int4 Engine+lookup b1", e["decode_tps"])
        add("tokens int4 Engine+lookup", e["tokens"])
        add("int4 bare b8", bare(int4, 8)[0])
        if "int4 a8" in models:  # int8 activations (meshlm serve --activations int8)
            tps, toks = bare(models["int4 a8"], 1)
            add("int4 a8 b1", tps)
            add("tokens int4 a8", toks)
            add("int4 a8 b8", bare(models["int4 a8"], 8)[0])
        own_thread(_step_rounds, int4, ids, n, add)
        if _dot_product_here():  # the same kernels with FMAs for the dot product
            with _without_dot_product():
                tps, toks = bare(int4, 1)
                add("int4 fma b1", tps)
                add("tokens int4 fma", toks)
                add("int4 fma b8", bare(int4, 8)[0])
        add("int4 guard-off b1", bare(models["int4 guard-off"], 1)[0])
        for name in ("int4 torch-kernel", "int4 avx2"):  # the same model on other kernels
            if name in models:
                tps, toks = bare(models[name], 1)
                add(f"{name} b1", tps)
                add(f"tokens {name}", toks)
                add(f"{name} b8", bare(models[name], 8)[0])
                add(f"prefill {name}", own_thread(_bare_prefill, models[name], prompt))
        tps, toks = bare(bf16, 1)
        add("bf16 bare b1", tps)
        add("tokens bf16 bare", toks)
        add("bf16 bare b8", bare(bf16, 8)[0])
        if native_attention.why_not(bf16.model) is None:  # its attention in torch's SDPA
            bf16.model.native_attention = None
            try:
                tps, toks = bare(bf16, 1)
                add("bf16 sdpa b1", tps)
                add("tokens bf16 sdpa", toks)
                add("bf16 sdpa b8", bare(bf16, 8)[0])
            finally:
                native_attention.use(bf16.model, True)
        add("prefill int4 bare", own_thread(_bare_prefill, int4, prompt))
        if peer is not None:
            add("prefill llama.cpp", len(prompt) / peer.prefill(prompt))
        ttft = _with_engine(int4, lambda engine, p=prompt: _engine_call(engine, p, 1)["ttft"])
        add("prefill int4 Engine", len(prompt) / ttft)
        add("prefill bf16 bare", own_thread(_bare_prefill, bf16, prompt))
    r["lookup drafts"] = [tuple(drafts)]
    return r


def _dot_product_here() -> bool:
    build = isas.isa() if qmm.applies() else None
    return build is not None and isas.has_bf16_dot(build)


class _without_dot_product:
    """The native kernels (qmm.c, step.c) with FMAs where they use the bf16 dot-product
    instruction: what a CPU without avx512_bf16 runs, the same bits."""

    def __enter__(self) -> None:
        self.build = isas.isa()
        for lib in (qmm.library(self.build), native_step.library(self.build)):
            qmm.set_dot(lib, self.build, False)

    def __exit__(self, *exc) -> None:
        for lib in (qmm.library(self.build), native_step.library(self.build)):
            qmm.set_dot(lib, self.build)


def _perplexity_rows(models: dict, win: int, n_win: int) -> list[str]:
    text = stdlib_text()
    ppl, rows = {}, []
    for name in ("int4", "int4 a8", "bf16", "fp32"):
        lm = models.get(name) or own_thread(load, precision=name)
        ids = lm.tokenizer.encode(text)
        ppl[name] = own_thread(perplexity, lm.model, ids, win, n_win)
        served = None  # fp32 decodes slowly and like its forward
        if name != "fp32":
            served = own_thread(decode_perplexity, lm.model, ids, win, n_win)
        ppl[name + " decode"] = served
        label = "int4, int8 activations" if name == "int4 a8" else name
        cells = [f"{ppl[name]:.3f}", "-" if served is None else f"{served:.3f}"]
        rows.append(f"| {label} | {lm.info.weight_bytes / 2**20:.0f} | {cells[0]} | {cells[1]} |")
    a8 = [ppl[f"int4 a8{k}"] / ppl[f"int4{k}"] - 1 for k in ("", " decode")]
    rows += [
        "",
        f"int4 vs bf16 perplexity {100 * (ppl['int4'] / ppl['bf16'] - 1):+.2f} %; int4 with "
        f"int8 vs bf16 activations {100 * a8[0]:+.2f} % ({100 * a8[1]:+.2f} % through decode "
        "steps). int4 = exact Q4_1 -> int4pack g32 remap of every layer, output head int8 per "
        "channel (an int4 g32 head costs ~+7 % perplexity). int8 activations hold a second copy "
        "of the weights in their kernels' layout (counted).",
        "",
    ]
    return rows


def _load_with(env: str, value: str):
    """The int4 model loaded while `env` = `value` (its layers keep what they were built with)."""
    os.environ[env] = value
    try:
        return own_thread(load, precision="int4")
    finally:
        del os.environ[env]


def _cell(xs: list[float]) -> str:
    med = statistics.median(xs)
    return f"{med:.1f}" if len(xs) == 1 else f"{med:.1f} ({min(xs):.1f}-{max(xs):.1f})"


def _ratio(r: dict, a: str, b: str) -> float | None:
    """Median over rounds of a / b measured in the same round."""
    if a not in r or b not in r:
        return None
    return statistics.median(x / y for x, y in zip(r[a], r[b], strict=True))


def _speed_section(r: dict, peer: LlamaPeer | None, n: int, p_len: int, rounds: int) -> list:
    lines = [
        f"Decode, {n} greedy tokens after the same chat prompt ({n - 1} decode steps, wall time "
        f"of all of them); prefill, {p_len} tokens into an empty cache. tokens/s, median of "
        f"{rounds} interleaved round{'s' if rounds > 1 else ''} (min-max):",
        "",
        "| runtime | path | precision | batch | decode tok/s | prefill tok/s |",
        "|---|---|---|---|---|---|",
    ]
    rows = [
        ("ours", "bare (`generate.greedy`)", "int4", 1, "int4 bare b1", "prefill int4 bare"),
        ("ours", "Engine (submit -> events)", "int4", 1, "int4 Engine b1", "prefill int4 Engine"),
        (
            "ours",
            f"Engine, prompt-lookup speculation (K={SPECULATE_K})",
            "int4",
            1,
            "int4 Engine+lookup b1",
            None,
        ),
        ("ours", "bare, non-finite guard off", "int4", 1, "int4 guard-off b1", None),
        ("ours", "bare forward", "int4", 8, "int4 bare b8", None),
        ("ours", "bare, int8 activations (`--activations int8`)", "int4", 1, "int4 a8 b1", None),
        ("ours", "bare, int8 activations (`--activations int8`)", "int4", 8, "int4 a8 b8", None),
        ("ours", "bare, native decode step", "int4", 1, "int4 native step b1", None),
        ("ours", "bare, decode step in torch ops", "int4", 1, "int4 torch step b1", None),
        ("ours", "bare, native decode step", "int4", 8, "int4 native step b8", None),
        ("ours", "bare, decode step in torch ops", "int4", 8, "int4 torch step b8", None),
        (
            "ours",
            "bare, torch's int4/int8 kernels",
            "int4",
            1,
            "int4 torch-kernel b1",
            "prefill int4 torch-kernel",
        ),
        (
            "ours",
            "bare forward, torch's int4/int8 kernels",
            "int4",
            8,
            "int4 torch-kernel b8",
            None,
        ),
        ("ours", "bare, FMAs for the bf16 dot product", "int4", 1, "int4 fma b1", None),
        ("ours", "bare forward, FMAs for the bf16 dot product", "int4", 8, "int4 fma b8", None),
        ("ours", "bare, native AVX2 build", "int4", 1, "int4 avx2 b1", "prefill int4 avx2"),
        ("ours", "bare forward, native AVX2 build", "int4", 8, "int4 avx2 b8", None),
        ("ours", "bare forward", "bf16", 1, "bf16 bare b1", "prefill bf16 bare"),
        ("ours", "bare forward", "bf16", 8, "bf16 bare b8", None),
        ("ours", "bare, attention in torch's SDPA", "bf16", 1, "bf16 sdpa b1", None),
        ("ours", "bare, attention in torch's SDPA", "bf16", 8, "bf16 sdpa b8", None),
        ("llama.cpp", "`Llama.eval` + argmax", "Q4_1", 1, "llama.cpp b1", "prefill llama.cpp"),
        ("llama.cpp", "8 sequences per `llama_decode` + argmax", "Q4_1", 8, "llama.cpp b8", None),
    ]
    for who, path, prec, batch, dec, pre in rows:
        if dec not in r:
            continue
        pre_cell = _cell(r[pre]) if pre in r else "-"
        lines.append(f"| {who} | {path} | {prec} | {batch} | {_cell(r[dec])} | {pre_cell} |")
    ratios = {
        "int4 decode b1, bare / llama.cpp": _ratio(r, "int4 bare b1", "llama.cpp b1"),
        "int4 decode b1, Engine / llama.cpp": _ratio(r, "int4 Engine b1", "llama.cpp b1"),
        "int4 prefill, bare / llama.cpp": _ratio(r, "prefill int4 bare", "prefill llama.cpp"),
        "int4 decode, b8 / b1 aggregate": _ratio(r, "int4 bare b8", "int4 bare b1"),
        "bf16 decode, b8 / b1 aggregate": _ratio(r, "bf16 bare b8", "bf16 bare b1"),
        "int4 decode b1, Engine / bare": _ratio(r, "int4 Engine b1", "int4 bare b1"),
        "int4 decode b8, bare / llama.cpp": _ratio(r, "int4 bare b8", "llama.cpp b8"),
        "int4 decode b8, int8 activations / llama.cpp": _ratio(r, "int4 a8 b8", "llama.cpp b8"),
        "llama.cpp decode, b8 / b1 aggregate": _ratio(r, "llama.cpp b8", "llama.cpp b1"),
        "int4 decode, b8 / b1 aggregate, int8 activations": _ratio(r, "int4 a8 b8", "int4 a8 b1"),
        "int4 decode b1, int8 activations / llama.cpp": _ratio(r, "int4 a8 b1", "llama.cpp b1"),
        "int4 decode b1, int8 / bf16 activations": _ratio(r, "int4 a8 b1", "int4 bare b1"),
        "int4 decode b8, int8 / bf16 activations": _ratio(r, "int4 a8 b8", "int4 bare b8"),
        "int4 decode b1, Engine+lookup / bare": _ratio(r, "int4 Engine+lookup b1", "int4 bare b1"),
        "int4 decode b1, native / torch's kernels": _ratio(
            r, "int4 bare b1", "int4 torch-kernel b1"
        ),
        "int4 decode b8, native / torch's kernels": _ratio(
            r, "int4 bare b8", "int4 torch-kernel b8"
        ),
        "int4 prefill, native / torch's kernels": _ratio(
            r, "prefill int4 bare", "prefill int4 torch-kernel"
        ),
        "int4 decode b1, native step / torch ops": _ratio(
            r, "int4 native step b1", "int4 torch step b1"
        ),
        "int4 decode b8, native step / torch ops": _ratio(
            r, "int4 native step b8", "int4 torch step b8"
        ),
        "int4 CPU s per token b1, native step / torch ops": _ratio(
            r, "cpu ms/token int4 native step", "cpu ms/token int4 torch step"
        ),
        "bf16 decode b8, native attention / torch's SDPA": _ratio(
            r, "bf16 bare b8", "bf16 sdpa b8"
        ),
        "bf16 decode, b8 / b1 aggregate, torch's SDPA": _ratio(r, "bf16 sdpa b8", "bf16 sdpa b1"),
        "int4 decode, b8 / b1 aggregate, torch's kernels": _ratio(
            r, "int4 torch-kernel b8", "int4 torch-kernel b1"
        ),
        "int4 decode b1, bf16 dot product / FMAs": _ratio(r, "int4 bare b1", "int4 fma b1"),
        "int4 decode b8, bf16 dot product / FMAs": _ratio(r, "int4 bare b8", "int4 fma b8"),
        "int4 decode b1, native AVX2 build / AVX-512 build": _ratio(
            r, "int4 avx2 b1", "int4 bare b1"
        ),
        "int4 decode b1, native AVX2 build / torch's kernels": _ratio(
            r, "int4 avx2 b1", "int4 torch-kernel b1"
        ),
    }
    lines += [
        "",
        "| ratio (median of per-round ratios) | value | goal (issue 13) |",
        "|---|---|---|",
    ]
    for name, value in ratios.items():
        goal = GOALS.get(name)
        if value is None and goal is None:
            continue
        shown = "no peer" if value is None else f"{value:.2f}x"
        target = "-" if goal is None else f">= {goal}x"
        if value is not None and goal is not None:
            target += " met" if value >= goal else " not met"
        lines.append(f"| {name} | {shown} | {target} |")
    eng = _first_difference(r["tokens int4 bare"][0], r["tokens int4 Engine"][0])
    lines += ["", f"Greedy ids, int4: Engine vs bare forward {eng}"]
    spec = _first_difference(r["tokens int4 bare"][0], r["tokens int4 Engine+lookup"][0])
    kept, drafted = r["lookup drafts"][0]
    lines[-1] += f"; Engine with lookup vs bare {spec} ({kept} of {drafted} drafts kept)"
    if "tokens int4 a8" in r:
        a8 = _first_difference(r["tokens int4 bare"][0], r["tokens int4 a8"][0])
        lines[-1] += f"; int8 vs bf16 activations {a8}"
    if "tokens int4 torch-kernel" in r:
        tk = _first_difference(r["tokens int4 bare"][0], r["tokens int4 torch-kernel"][0])
        lines[-1] += f"; native vs torch's kernels {tk}"
    if "tokens int4 fma" in r:
        fm = _first_difference(r["tokens int4 bare"][0], r["tokens int4 fma"][0])
        lines[-1] += f"; bf16 dot product vs FMAs {fm}"
    if "tokens int4 avx2" in r:
        a2 = _first_difference(r["tokens int4 bare"][0], r["tokens int4 avx2"][0])
        lines[-1] += f"; native AVX2 vs AVX-512 build {a2}"
    if "tokens int4 torch step" in r:
        ts = _first_difference(r["tokens int4 native step"][0], r["tokens int4 torch step"][0])
        lines[-1] += f"; native decode step vs torch ops {ts}"
        cpu = [_cell(r[f"cpu ms/token int4 {k} step"]) for k in ("native", "torch")]
        lines[-1] += f" (CPU ms per token, b1, prefill included: {cpu[0]} vs {cpu[1]})"
    if "tokens bf16 sdpa" in r:
        na = _first_difference(r["tokens bf16 bare"][0], r["tokens bf16 sdpa"][0])
        lines[-1] += f"; bf16: native attention vs torch's SDPA {na}"
    if peer is not None:
        peer_cmp = _first_difference(r["tokens int4 bare"][0], r["tokens llama.cpp"][0])
        lines[-1] += f"; ours vs llama.cpp {peer_cmp} (its kernels round activations to 8 bits)"
        rows = _first_difference(r["tokens llama.cpp"][0], r["tokens llama.cpp b8"][0])
        lines[-1] += f"; llama.cpp's first of 8 sequences vs its batch 1 {rows}"
    lines[-1] += "."
    return lines


def _busy_warning(load: float) -> list[str]:
    if load <= (os.cpu_count() or 1):
        return []
    return [
        f"**The machine was busy (load {load:.1f} on {os.cpu_count()} cores): these figures "
        "are not a comparison.** Both runtimes split work across threads that meet at a barrier "
        "per op; with more runnable threads than cores, a descheduled thread stalls the others "
        "(llama.cpp's OpenMP barriers, ~15 per layer, suffer most)."
    ]


def _peer_line(peer: LlamaPeer | None, why_not: str) -> str:
    if peer is None:
        return f"llama.cpp peer: {why_not}"
    return (
        f"llama.cpp peer: llama-cpp-python, the same GGUF and token ids, {peer.threads} threads; "
        f"its build: `{peer.system_info}`."
    )


def main(quick: bool) -> str:
    load0 = os.getloadavg()
    n, p_len, rounds = (32, 128, 1) if quick else (128, 512, 3)
    win, n_win = (256, 1) if quick else (512, 6)
    threads = torch.get_num_threads()
    peer, why_not = None, ""
    if not installed():
        why_not = (
            "**not installed**: `make bench-peer` builds llama-cpp-python from source (many "
            "minutes on 2 cores); no comparison in this run."
        )
    else:
        try:
            peer = LlamaPeer(str(default_gguf_path()), threads)
        except PeerError as e:
            why_not = f"**failed to start**: {e}; no comparison in this run."
    # Torch work of this process runs on threads of its own (model_runtime/engine/omp.py): this one
    # starts no OpenMP pool that would outlive a measurement.
    models = {
        "int4": own_thread(load, precision="int4"),
        "int4 guard-off": own_thread(load, precision="int4", nonfinite_guard=False),
        "int4 a8": own_thread(load, precision="int4", activations="int8"),
        "bf16": own_thread(load, precision="bf16"),
    }
    # Which build of the native kernels ran (if any) is what compute.choose says at load: the
    # bench names no instruction set of its own.
    kernel_line = (
        f"Compute chosen at load for this CPU (`compute.choose`): int4 model: "
        f"{models['int4'].info.compute}; bf16 model: {models['bf16'].info.compute} "
        "(`python -m bench compute`: both choices with and without native bf16 matmuls)."
    )
    kernel_line += (
        " The same int4 model on torch's int4/int8 kernels (MESHLM_INT4_KERNEL=torch) is "
        "measured beside the native ones in every round."
        if qmm.applies()
        else f" No native int4/int8 kernels here: {qmm.why_not()}."
    )
    if qmm.applies():  # the same model on torch's kernels, for the A/B in one run
        models["int4 torch-kernel"] = _load_with("MESHLM_INT4_KERNEL", "torch")
    if isas.isa() == "avx512" and isas.runs("avx2"):  # what an AVX2-only CPU runs
        models["int4 avx2"] = _load_with(isas.ISA_ENV, "avx2")
        kernel_line += (
            f" So is the AVX2 build of the native kernels ({isas.ISA_ENV}=avx2: what a CPU "
            "without AVX-512 runs; the same bits, half-width vectors)."
        )
    try:
        r = _speed_rounds(models, peer, n, p_len, rounds)
    except PeerError as e:  # the peer died mid-run: measure ours alone
        peer.close()
        peer, why_not = None, f"**died during the run**: {e}."
        r = _speed_rounds(models, None, n, p_len, rounds)
    finally:
        if peer is not None:
            peer.close()
    lines = [
        "## Model runtime (SmolLM2-135M-Instruct)",
        "",
        f"Machine: {describe()}; torch {torch.__version__}, {threads} threads, kernels "
        f"dispatched for {torch.backends.cpu.get_cpu_capability()}.",
        f"CPU features: {describe_flags()}.",
        kernel_line,
        _peer_line(peer, why_not),
        f"Command: `python -m bench runtime{' --quick' if quick else ''}`.",
        f"Load average at start {load0[0]:.1f} (on a busy machine absolute speeds drop; the "
        "ratios are measured in one run).",
        *_busy_warning(load0[0]),
        "",
        *_speed_section(r, peer, n, p_len, rounds),
        "Earlier versions of this section reported 1 / the median decode step of the bare "
        "forward (best of 3 runs) against llama.cpp's high-level completion API including "
        "prefill and sampling; those figures are not comparable with these. Each of our "
        "measurements runs alone on a thread of its own or on a fresh Engine's "
        "(model_runtime/engine/omp.py: a second OpenMP pool on 2 cores halves decode speed); "
        "sections measured before that ran beside a used Engine's pool and read low.",
        "",
        f"Perplexity over {n_win}x{win} tokens of pydoc_data/topics.py: one forward a window "
        "(prefill), and through decode steps (`perplexity.decode_perplexity`: each token fed "
        "alone, as served; the windows decode as one batch).",
        "",
        "| precision | weights MiB | perplexity | perplexity through decode steps |",
        "|---|---|---|---|",
    ]
    lines += _perplexity_rows(models, win, n_win)
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
            p = _poisson_load(models["int4"], rate, n_req, static, max_new)
            lines.append(
                f"| {rate} | {'static' if static else 'continuous'} | {1000 * p['ttft50']:.0f} | "
                f"{1000 * p['ttft99']:.0f} | {1000 * p['tpot50']:.0f} | {1000 * p['tpot99']:.0f} |"
            )
    lines += ["", f"Load average at end {os.getloadavg()[0]:.1f}.", ""]
    return "\n".join(lines)

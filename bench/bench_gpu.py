"""GPU benchmark (issue 13, item 7): the runtime's fp16 and bf16 CUDA path on a GPU, beside
Hugging Face transformers reading the same GGUF, and xformers' attention beside torch's SDPA.

Decode is measured as `python -m bench runtime` measures it: the same chat prompt, prefilled
(not timed), then N greedy tokens; the figure is the N - 1 decode steps over the wall time of
all of them (each step ends when its argmax reaches Python). transformers runs its own low-level
loop the same way (one forward a token over its KV cache, argmax, the id back to Python), on the
weights it dequantizes from the same GGUF, and its greedy ids are compared with ours. Rounds
interleave every variant; figures are medians over rounds.

`python -m bench gpu` (--quick: fewer tokens, one round). Without a CUDA device it measures
nothing and leaves bench/results/gpu.md (the figures of the last GPU that ran it) as it is.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import threading
import time

import torch
import torch.nn.functional as F

from bench.bench_runtime import (
    STORY,
    _bare_decode,
    _bare_prefill,
    _engine_call,
    _first_difference,
    _with_engine,
)
from bench.machine import describe
from model_runtime.engine import generate
from model_runtime.engine.perplexity import decode_perplexity, perplexity, stdlib_text
from model_runtime.engine.warmup import warm_up
from model_runtime.llm import cuda_graphs
from model_runtime.loading.gguf_loader import default_gguf_path
from model_runtime.loading.loader import load

FRANCE = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
BATCHES = (1, 8, 64)
# SmolLM2-135M's attention: 9 query heads over 3 KV heads of 64; (batch, new tokens, keys)
ATTENTION_SHAPES = ((1, 512, 512), (8, 1, 640), (64, 1, 640))


def _gpu_line() -> str:
    p = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "?"
    return (
        f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, driver "
        f"{driver}; torch {torch.__version__} (CUDA {torch.version.cuda})"
    )


def _hf_model(dtype: torch.dtype):
    """transformers' Llama on the weights it dequantizes from our GGUF."""
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.to("cuda").eval()


@torch.inference_mode()
def _hf_decode(model, ids: list[int], n: int, batch: int) -> tuple[float, list[int]]:
    """transformers' forward a token over its own cache, as `_bare_decode` times ours."""
    out = model(input_ids=torch.tensor([ids] * batch, device="cuda"), use_cache=True)
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    tokens, seconds = [nxt[0, 0].item()], 0.0
    for _ in range(n - 1):
        t0 = time.perf_counter()
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt.tolist()[0][0])
        seconds += time.perf_counter() - t0
    return batch * (n - 1) / seconds, tokens


@torch.inference_mode()
def _hf_prefill(model, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    logits = model(input_ids=torch.tensor([prompt], device="cuda"), use_cache=True).logits
    logits[:, -1].argmax().item()  # waits for the GPU, as our prefill's argmax does
    return len(prompt) / (time.perf_counter() - t0)


def _engine_concurrent(lm, ids: list[int], n: int, k: int) -> float:
    """Tokens/s of k identical requests submitted at once to one Engine: all their tokens over
    the wall time from submitting to the last token, prefills included. The Engine is warmed up
    as served (model_runtime/engine/warmup.py: on a GPU that captures the graphs of batch 1..k)."""

    def run(engine) -> float:
        warm_up(engine, lm.tokenizer)  # as `meshlm serve` does: decode at batch 1..k once
        done: list[dict] = []
        threads = [
            threading.Thread(target=lambda: done.append(_engine_call(engine, ids, n)))
            for _ in range(k)
        ]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(len(d["tokens"]) for d in done) / (time.perf_counter() - t0)

    return _with_engine(lm, run, max_batch=k)


def _step_profile(lm, ids: list[int]) -> tuple[float, float]:
    """(CUDA kernels a b1 decode step, their summed GPU time in us a step), from torch's
    profiler over 16 decode steps and the prefill before them (counted as a 17th step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate.greedy(lm, [ids], 17, stop=False)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels) / 17, sum(e.time_range.elapsed_us() for e in kernels) / 17


def _cuda_ms(fn, reps: int = 50) -> float:
    """Median ms of `fn` over reps, CUDA events around each, after 10 warm-ups."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _attention_rows() -> list[str]:
    """xformers' memory_efficient_attention beside SDPA at SmolLM2's shapes, fp16."""
    try:
        import xformers
        import xformers.ops as xops
    except Exception as e:  # any import failure is the finding
        return [f"xformers: not importable here ({type(e).__name__}: {e})."]
    rows = [
        f"xformers {xformers.__version__} beside torch's SDPA, fp16, SmolLM2's attention "
        "(9 query heads over 3 KV heads of 64; random inputs; median of 50 calls, CUDA events):",
        "",
        "| batch x new tokens x keys | SDPA us | xformers us | SDPA / xformers time | "
        "rel. difference |",
        "|---|---|---|---|---|",
    ]
    for B, T, L in ATTENTION_SHAPES:
        q = torch.randn(B, T, 9, 64, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(B, L, 3, 64, device="cuda", dtype=torch.float16) for _ in "kv")

        def sdpa(q=q, k=k, v=v, T=T):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=T > 1,
                enable_gqa=True,
            ).transpose(1, 2)

        bias = xops.LowerTriangularMask() if T > 1 else None
        # BMGHK: query head g * 3 + h reads KV head g, as SDPA's enable_gqa
        kx, vx = (t.view(B, L, 3, 1, 64).expand(B, L, 3, 3, 64) for t in (k, v))

        def xf(q=q, kx=kx, vx=vx, bias=bias, B=B, T=T):
            qx = q.view(B, T, 3, 3, 64)
            return xops.memory_efficient_attention(qx, kx, vx, attn_bias=bias).view(B, T, 9, 64)

        try:
            ref, got = sdpa().float(), xf().float()
            diff = ((got - ref).norm() / ref.norm()).item()
            t_s, t_x = _cuda_ms(sdpa), _cuda_ms(xf)
            rows.append(
                f"| {B} x {T} x {L} | {1000 * t_s:.1f} | {1000 * t_x:.1f} | {t_s / t_x:.2f}x | "
                f"{diff:.1e} |"
            )
        except NotImplementedError as e:  # no operator built for this torch / CUDA
            why = sorted({ln.strip() for ln in str(e).splitlines() if "xFormers wasn't" in ln})
            return [
                f"xformers {xformers.__version__} imports, but runs no attention here "
                f"(torch {torch.__version__}): {str(e).splitlines()[0]} "
                f"({'; '.join(why) or 'see python -m xformers.info'}).",
                "",
            ]
        except Exception as e:
            rows.append(f"| {B} x {T} x {L} | failed: {type(e).__name__}: {e} | | | |")
    return [*rows, ""]


def _median(xs: list[float]) -> str:
    med = statistics.median(xs)
    return f"{med:.0f}" if len(xs) == 1 else f"{med:.0f} ({min(xs):.0f}-{max(xs):.0f})"


def _quality_lines(answers: dict, lms: list, text_ids: list[int], win: int, n_win: int) -> list:
    """The capital-of-France answers (name -> ids), and perplexity of each (name, model) over
    `text_ids` (the stdlib text's)."""
    tok = lms[0][1].tokenizer
    lines = [
        "",
        '"What is the capital of France? Answer with one word.", greedy:',
        "",
        "| model | answer | ids equal CPU int4's |",
        "|---|---|---|",
    ]
    for name, a in answers.items():
        lines.append(f"| {name} | {tok.decode(a)!r} | {a == answers['CPU int4']} |")
    lines += [
        "",
        f"Perplexity over {n_win}x{win} tokens of Python {platform.python_version()}'s "
        "pydoc_data/topics.py (each Python release rewrites it: compare within this table; one "
        "forward a window; through decode steps, as served):",
        "",
        "| model | perplexity | through decode steps |",
        "|---|---|---|",
    ]
    for name, lm in lms:
        ppl = perplexity(lm.model, text_ids, win, n_win)
        served = decode_perplexity(lm.model, text_ids, win, n_win)
        lines.append(f"| {name} | {ppl:.3f} | {served:.3f} |")
    gpu = [(n, lm) for n, lm in lms if not n.startswith("CPU") and lm.guard is not None]
    fallbacks = ", ".join(f"{n} {lm.guard.fallbacks}" for n, lm in gpu)
    return [
        *lines,
        "",
        f"Layers the non-finite guard recomputed over the whole run: {fallbacks}.",
        "",
    ]


def measure(quick: bool, device: str = "cuda", precisions=("fp16", "bf16")) -> list[str]:
    """The section's lines. device/precisions other than the defaults are for a smoke run of
    this code on a machine without a GPU (the transformers peer and xformers then say why not)."""
    n, p_len, rounds = (16, 128, 1) if quick else (128, 512, 3)
    win, n_win = (256, 1) if quick else (512, 6)
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    t0 = time.perf_counter()
    models = {p: load(precision=p, device=device) for p in precisions}
    sync()
    load_s = (time.perf_counter() - t0) / len(precisions)
    ref = {p: load(precision=p) for p in ("int4", "bf16")}  # this machine's CPU, as served
    tok = ref["int4"].tokenizer
    ids, france = tok.encode_chat(STORY), tok.encode_chat(FRANCE)
    text_ids = tok.encode(stdlib_text())
    main = precisions[0]
    hf, hf_why = None, ""
    try:
        hf = _hf_model(models[main].model.dtype) if device == "cuda" else None
        hf_why = "" if hf is not None else "no CUDA device"
    except Exception as e:  # the peer's failure is reported; ours still run
        hf_why = f"{type(e).__name__}: {e}"
    r: dict[str, list] = {}

    def add(name: str, value) -> None:
        r.setdefault(name, []).append(value)
        if isinstance(value, float):  # progress, and the figures so far if a run is cut short
            print(f"  {name}: {value:.1f}", flush=True)

    # name -> (model, its decode step: a GraphStep, or None for eager torch ops)
    graphs = {p: cuda_graphs.GraphStep(m.model) for p, m in models.items() if device == "cuda"}
    graph_error = ""
    for p, g in list(graphs.items()):  # a failure to capture is a finding: eager still runs
        models[p].model.native_step = g
        try:
            generate.greedy(models[p], [ids] * 3, 4, stop=False)
        except Exception as e:
            graph_error = f"CUDA graphs failed ({p}): {type(e).__name__}: {e}"
            print(graph_error, flush=True)
            del graphs[p]
            models[p].model.native_step = None
    lms = [*models.items(), *((f"CPU {p}", m) for p, m in ref.items())]
    # as served: GPU models with graphs where they apply
    answers = {name: generate.greedy(lm, [france], 16)[0] for name, lm in lms}
    variants = {p: (lm, graphs.get(p)) for p, lm in models.items()}
    if main in graphs:
        variants[f"{main} eager"] = (models[main], None)

    def one_round(n: int, prompt: list[int], add) -> None:
        for b in BATCHES:
            for name, (lm, step) in variants.items():
                lm.model.native_step, lm.model.native_attention = step, None
                tps, toks = _bare_decode(lm, ids, n, b)
                add(f"{name} b{b}", tps)
                add(f"tokens {name}", toks)
            if hf is not None:
                tps, toks = _hf_decode(hf, ids, n, b)
                add(f"hf b{b}", tps)
                add("tokens hf", toks)
        for p, lm in models.items():  # as served: graphs where they apply
            lm.model.native_step = graphs.get(p)
        e = _with_engine(models[main], lambda engine: _engine_call(engine, ids, n))
        add("engine b1", e["decode_tps"])
        add("engine ttft", 1000 * e["ttft"])
        add("engine b8", _engine_concurrent(models[main], ids, n, 8))
        for p, lm in models.items():
            add(f"prefill {p}", _bare_prefill(lm, prompt))
        if hf is not None:
            add("prefill hf", _hf_prefill(hf, prompt))

    # warm-up, not recorded: every variant and shape once (allocations, cuBLAS plans, graphs)
    one_round(n, text_ids[:p_len], lambda name, value: None)
    captured = sum(g.captures for g in graphs.values())
    for i in range(rounds):
        one_round(n, text_ids[(i + 1) * p_len : (i + 2) * p_len], add)
    captured = sum(g.captures for g in graphs.values()) - captured
    lines = [
        f"Decode, {n} greedy tokens after the same chat prompt ({n - 1} decode steps, wall time "
        f"of all of them), aggregate tokens/s, medians of {rounds} interleaved rounds (range):",
        "",
        "| tokens/s | " + " | ".join(f"batch {b}" for b in BATCHES) + " | prefill "
        f"{p_len} tokens |",
        "|---|" + "---|" * (len(BATCHES) + 1),
    ]
    for name, (_, step) in variants.items():
        p = name.split()[0]
        cells = [_median(r[f"{name} b{b}"]) for b in BATCHES] + [_median(r[f"prefill {p}"])]
        how = "CUDA graphs" if step is not None else "eager"
        lines.append(f"| meshlm {p}, bare forward, {how} | " + " | ".join(cells) + " |")
    if hf is not None:
        cells = [_median(r[f"hf b{b}"]) for b in BATCHES] + [_median(r["prefill hf"])]
        lines.append(f"| transformers {main} (same GGUF) | " + " | ".join(cells) + " |")
    lines.append(
        f"| meshlm {main}, Engine (submit -> tokens){', CUDA graphs' if main in graphs else ''}"
        f" | {_median(r['engine b1'])} | "
        f"{_median(r['engine b8'])} (8 requests at once, their prefills included) | - | - |"
    )
    lines.append("")
    med = {k: statistics.median(v) for k, v in r.items() if not k.startswith("tokens")}
    b1, b8 = med[f"{main} b1"], med[f"{main} b8"]
    lines.append(
        f"{main}: batch 8 / batch 1 {b8 / b1:.2f}x; Engine / bare at batch 1 "
        f"{med['engine b1'] / b1:.2f}x; Engine TTFT of the chat prompt "
        f"{_median(r['engine ttft'])} ms."
    )
    eager = f"{main} eager"
    if graph_error:
        lines.append(graph_error)
    if eager in variants:
        ratios = [f"batch {b} {med[f'{main} b{b}'] / med[f'{eager} b{b}']:.2f}x" for b in BATCHES]
        lines.append(
            f"CUDA graphs / eager, {main} decode: {', '.join(ratios)} ({captured} graphs "
            "captured during the timed rounds, their capture inside the timed steps: each call "
            "of the bare forward allocates its own cache, and a graph is bound to a cache's "
            "address)."
        )
    if hf is not None:
        for name in (main, eager) if eager in variants else (main,):
            ratios = [f"batch {b} {med[f'{name} b{b}'] / med[f'hf b{b}']:.2f}x" for b in BATCHES]
            lines.append(f"meshlm {name} / transformers {main}, decode: {', '.join(ratios)}.")
    else:
        lines.append(f"transformers peer: not run ({hf_why}).")
    lines.append("")
    streams = {name: r[f"tokens {name}"][0] for name in variants}
    if hf is not None:
        streams[f"transformers {main}"] = r["tokens hf"][0]
    cpu_story = generate.greedy(ref["int4"], [ids], n, stop=False)[0]
    lines.append(
        f"Greedy ids of the {n}-token story against meshlm int4 on this machine's CPU: "
        + "; ".join(f"{k} {_first_difference(v, cpu_story)}" for k, v in streams.items())
        + "."
    )
    if hf is not None:
        lines.append(
            f"meshlm {main} against transformers {main}: "
            f"{_first_difference(streams[main], streams[f'transformers {main}'])}."
        )
    lines += _quality_lines(answers, lms, text_ids, win, n_win)
    if device == "cuda":
        model = models[main].model
        model.native_step = None  # the eager step: graphs replay the same kernels
        try:
            kernels, busy = _step_profile(models[main], ids)
        except Exception as e:  # the profiler's API moves between torch versions
            kernels, busy = 0.0, float("nan")
            lines.append(f"torch.profiler failed: {type(e).__name__}: {e}")
        model.native_step = graphs.get(main)
        step_us = 1e6 / med.get(f"{eager} b1", b1)
        replayed = f" Replayed from a graph it takes {1e6 / b1:.0f} us." if main in graphs else ""
        mib = models[main].info.weight_bytes / 2**20
        lines += [
            f"Where an eager {main} batch-1 decode step goes (torch.profiler): {kernels:.0f} "
            f"CUDA kernels, {busy:.0f} us of GPU time in a {step_us:.0f} us step "
            f"({100 * busy / step_us:.0f} %).{replayed} Its weights ({mib:.0f} MiB) read once at "
            f"4.3 TB/s (an H200's measured copy bandwidth) would take ~{mib * 2**20 / 4.3e6:.0f} "
            "us.",
            "",
        ]
        lines += _attention_rows()
    lines.append(f"Load of each GPU model from the GGUF: {load_s:.1f} s.")
    return lines


def main(quick: bool) -> str | None:
    if not torch.cuda.is_available():
        print(
            "bench gpu: no CUDA device here (torch.cuda.is_available() is False); "
            "bench/results/gpu.md keeps the last GPU's figures."
        )
        return None
    lines = [
        "## GPU path (SmolLM2-135M-Instruct, CUDA)",
        "",
        f"GPU: {_gpu_line()}. Host: {describe()}.",
        f"Command: `python -m bench gpu{' --quick' if quick else ''}`. Peer: Hugging Face "
        "transformers (its Llama on the same GGUF's weights, its own KV cache, eager), the "
        "reference implementation GPU runtimes are compared with. vLLM is not on the lent GPU "
        "machine and cannot be installed there (no package registry; its wheel is larger than "
        "what a call can carry).",
        "",
        *measure(quick),
    ]
    return "\n".join(lines) + "\n"

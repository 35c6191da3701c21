"""`meshlm generate`: stream a generation from a runtime or, through a sidecar, from the mesh, with
the caller library (meshlm.client): a stream whose replica stalls or dies resumes on another."""

from __future__ import annotations

import argparse
import sys

from mesh_common.headers import API_KEY_HEADER


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt (sent as one user chat message unless --raw)")
    p.add_argument("--target", required=True, help="HOST:PORT of a runtime or sidecar")
    p.add_argument("--api-key", help="sent as x-api-key (checked by the sidecar's authz filter)")
    p.add_argument("--authority", help="mesh service name (:authority) when going via a sidecar")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat")
    p.add_argument("--system", help="a system message")
    p.add_argument(
        "--header",
        action="append",
        default=[],
        type=_header,
        metavar="NAME:VALUE",
        help="send a gRPC metadata header, e.g. x-canary:always (repeatable)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1: off")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest; 0: off")
    p.add_argument("--seed", type=int, help="sampling seed, for a repeatable sampled answer")
    p.add_argument("--stop", action="append", default=[], help="a stop sequence (repeatable)")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    p.add_argument("--stats", action="store_true", help="print TTFT and token count to stderr")


def _header(text: str) -> tuple[str, str]:
    """("x-canary", "always") from "x-canary:always" (gRPC metadata keys are lower case)."""
    name, sep, value = text.partition(":")
    name = name.strip().lower()
    if not sep or not name or name.startswith(":") or not value.strip():
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, e.g. x-canary:always, got {text!r}")
    if name == API_KEY_HEADER:
        raise argparse.ArgumentTypeError("the API key goes in --api-key, not --header")
    return name, value.strip()


def run(args: argparse.Namespace) -> int:
    import grpc

    from meshlm.client.caller import Caller
    from meshlm.client.errors import InvalidArgument
    from model_runtime.serving.client import GENERATE

    if args.raw:
        what = {"prompt": args.prompt}
    else:
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        what = {"messages": [*msgs, {"role": "user", "content": args.prompt}]}
    tokens, ttft_us, reason = 0, None, None
    caller = Caller(
        args.target, api_key=args.api_key, authority=args.authority, metadata=args.header
    )
    try:
        stream = caller.generate(
            timeout=args.timeout,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
            **what,
        )
    except InvalidArgument as e:  # found before sending: a usage error
        caller.close()
        print(f"meshlm generate: invalid request: {e.details()}", file=sys.stderr)
        return 2
    try:
        for chunk in stream:
            sys.stdout.write(chunk.text_delta)
            sys.stdout.flush()
            tokens += len(chunk.token_ids)
            ttft_us = chunk.ttft_us if ttft_us is None else ttft_us
            reason = chunk.finish_reason or reason
    except grpc.RpcError as e:
        detail = e.details() or ""
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # Envoy's 404: no route, empty details
            whom = f"authority {args.authority!r}" if args.authority else "its default authority"
            hint = "is --authority a service of the mesh, the target a runtime or sidecar?"
            detail = f"{detail}; " if detail else ""
            detail += f"{args.target} has no route to {GENERATE} for {whom} ({hint})"
        elif e.code() == grpc.StatusCode.UNAVAILABLE and not tokens and _speaks_tls(args.target):
            detail += (
                f"; {args.target} speaks TLS: a sidecar's inbound port takes only mTLS from "
                "mesh workloads. Call through a caller sidecar instead: --target "
                "127.0.0.1:PORT of its --outbound-port, with --authority SERVICE"
            )
        newline = "\n" if tokens else ""
        print(f"{newline}meshlm generate: {e.code().name}: {detail}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        stream.close()
        caller.close()
    sys.stdout.write("\n")
    if args.stats:
        ttft = "-" if ttft_us is None else f"{ttft_us / 1000:.0f} ms"
        resumed = f", resumed {len(stream.resumes)}x" if stream.resumes else ""
        print(f"[{tokens} tokens, finish {reason}, TTFT {ttft}{resumed}]", file=sys.stderr)
    return 0


def _speaks_tls(target: str) -> bool:
    from sidecar.supervisor import speaks_tls

    host, _, port = target.rpartition(":")
    if not port.isdigit():
        return False
    return bool(speaks_tls((host.strip("[]") or "127.0.0.1", int(port)), timeout=1.0))

"""The multi-host demo's programs that run inside a host, where gRPC's sockets must be opened:

`python -m meshlm.demo.host_client capacity --target HOST:PORT --slots N --tokens K` prints the
runtime's decode speed (tokens/s, JSON) measured straight against it;
`python -m meshlm.demo.host_client traffic --target HOST:PORT ... --out FILE` drives one tenant's
calls (its key in $MESHLM_API_KEY) against the caller host's own sidecar (the host-local hop, as
from a pod's container) until SIGTERM or `--max-seconds`, then writes every call's outcome to
FILE as JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
from pathlib import Path

API_KEY_ENV = "MESHLM_API_KEY"  # the tenant's key: in the environment, never on a command line


def _capacity(args: argparse.Namespace) -> int:
    from meshlm.demo.scenarios.capacity import decode_capacity

    speed = decode_capacity(args.target, args.slots, tokens=args.tokens)
    print(json.dumps({"tokens_per_s": speed}), flush=True)
    return 0


def _traffic(args: argparse.Namespace) -> int:
    from meshlm.demo.traffic import TenantLoad, Traffic

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    api_key = os.environ.get(API_KEY_ENV, "")
    if not api_key:
        print(f"host_client traffic: no API key in ${API_KEY_ENV}", file=sys.stderr)
        return 2
    load = TenantLoad(args.tenant, api_key, rate=args.rate)
    traffic = Traffic(
        args.target, [load], authority=args.authority, max_new_tokens=args.max_new_tokens
    ).start()
    print("traffic: started", flush=True)
    stop.wait(args.max_seconds)
    traffic.stop()
    doc = [dataclasses.asdict(o) for o in traffic.outcomes]
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(args.out)  # whole or absent
    print(f"traffic: {len(doc)} calls written", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshlm.demo.host_client")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capacity")
    c.add_argument("--target", required=True)
    c.add_argument("--slots", type=int, default=2)
    c.add_argument("--tokens", type=int, default=16)
    t = sub.add_parser("traffic")
    t.add_argument("--target", required=True)
    t.add_argument("--authority", required=True)
    t.add_argument("--tenant", required=True)
    t.add_argument("--rate", type=float, required=True)
    t.add_argument("--max-new-tokens", type=int, default=8)
    t.add_argument("--max-seconds", type=float, default=600)
    t.add_argument("--out", required=True)
    args = p.parse_args(argv)
    return _capacity(args) if args.cmd == "capacity" else _traffic(args)


if __name__ == "__main__":
    sys.exit(main())

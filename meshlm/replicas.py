"""`meshlm xds-server --replicas N --store etcd://...`: N replica processes of the control
plane on one machine, each a plain `meshlm xds-server` with its own id and ports.
Their output is prefixed with their id; a replica that exits is reported and the others keep
serving (kill one to watch another take over); Ctrl-C stops them all."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from mesh_common.process_group import die_with, stop_group
from meshlm.signals import termination_event

MAX_REPLICAS = 9
# Set per replica by the launcher, never passed through.
_OWN = {"replicas", "replica_id", "grpc_port", "admin_port", "help"}


def launch_replicas(args: argparse.Namespace, stride: int) -> int:
    n = args.replicas
    if not 1 <= n <= MAX_REPLICAS:
        return _usage(f"--replicas: 1 to {MAX_REPLICAS}, got {n}")
    if not (args.store or "").startswith(("etcd://", "etcds://")):
        return _usage("--replicas needs --store etcd://HOST:PORT,... or etcds://... "
                      "(replicas share their state through etcd; `meshlm etcd` starts a local "
                      "one)")  # fmt: skip
    if args.isolation_store or args.rollout_store:
        # One file written by several processes keeps only the last writer's (each replica's
        # default is its own: .meshlm/isolation-<id>.json; rollouts live in the store).
        return _usage("--replicas: --isolation-store and --rollout-store name one file for "
                      "every replica; leave them out")  # fmt: skip
    try:
        grpc_port, admin_port = _first_ports(args)
    except (OSError, ValueError) as e:
        return _usage(str(e), code=2)
    common = _passed_through(args)
    prefix = args.replica_id or "r"
    procs: list[tuple[str, subprocess.Popen]] = []
    stop = termination_event()
    try:
        for i in range(n):
            rid = f"{prefix}{i + 1}"
            # An ephemeral port (0) stays one for each replica.
            ports = [port + stride * i if port else 0 for port in (grpc_port, admin_port)]
            argv = [sys.executable, "-m", "meshlm.cli", "xds-server", *common,
                    "--replica-id", rid, "--grpc-port", str(ports[0]),
                    "--admin-port", str(ports[1])]  # fmt: skip
            p = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches the launcher, which stops them in turn
                preexec_fn=die_with(os.getpid()),  # and a launcher killed takes them along
            )
            procs.append((rid, p))
            threading.Thread(target=_relay, args=(rid, p), daemon=True).start()
            print(f"replicas: {rid} (pid {p.pid}): ADS port {ports[0] or '(ephemeral)'}, "
                  f"admin port {ports[1] or '(ephemeral)'}", flush=True)  # fmt: skip
        if grpc_port:
            xds = ",".join(f"127.0.0.1:{grpc_port + stride * i}" for i in range(n))
            print(f"replicas: sidecars take them all: meshlm sidecar --xds {xds} ...", flush=True)
        reported: set[str] = set()
        while not stop.wait(0.5):
            for rid, p in procs:
                if p.poll() is not None and rid not in reported:
                    reported.add(rid)
                    print(f"replicas: {rid} exited ({p.returncode})", flush=True)
            if len(reported) == n:
                return 1
        return 0
    finally:
        for _, p in procs:
            with contextlib.suppress(ProcessLookupError):  # SIGTERM to all: they stop together
                os.killpg(p.pid, signal.SIGTERM)
        for _, p in procs:
            stop_group(p, timeout=20)


def _first_ports(args: argparse.Namespace) -> tuple[int, int]:
    """The first replica's ADS and admin ports: the flags, else the mesh file's. ValueError
    for a mesh whose fixed ports every replica would try to take."""
    from xds_server.mesh import MeshError, load_yaml, parse_mesh

    try:
        mesh = parse_mesh(load_yaml(Path(args.mesh).read_text(), args.mesh))
    except MeshError as e:
        raise ValueError(str(e)) from None
    cp = mesh.control_plane
    if mesh.identity and (cp.ca_port is not None or cp.ca_mtls_port is not None):
        raise ValueError(
            f"--replicas: {args.mesh} fixes control_plane.ca_port/ca_mtls_port, which every "
            "replica would take: leave them out (each replica's CA then listens on its ADS "
            "port + 2 and + 3)"
        )
    grpc = cp.grpc_port if args.grpc_port is None else args.grpc_port
    return grpc, cp.admin_port if args.admin_port is None else args.admin_port


def _passed_through(args: argparse.Namespace) -> list[str]:
    """The flags this command was given (not defaults), as each replica's command line."""
    from meshlm.cli import command_parser

    argv: list[str] = []
    for action in command_parser("xds-server")._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in _OWN or value == action.default:
            continue
        argv += [action.option_strings[-1], str(value)]
    return argv


def _relay(rid: str, p: subprocess.Popen) -> None:
    """A replica's output, each line prefixed with its id."""
    assert p.stdout is not None
    for line in iter(p.stdout.readline, b""):
        sys.stdout.write(f"[{rid}] {line.decode(errors='replace')}")
        sys.stdout.flush()
    p.stdout.close()


def _usage(message: str, code: int = 2) -> int:
    print(f"meshlm xds-server: {message}", file=sys.stderr)
    return code

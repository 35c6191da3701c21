"""`meshlm xds-server`: the control plane (ADS on gRPC, admin HTTP API) from a mesh file.

This reads the flags, the mesh file and the admin token; xds_server/compose.py builds and runs
every part."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from meshlm.signals import termination_event
from meshlm.state_dir import STATE_ENV, choose_state_dir
from xds_server.admin.token import TOKEN_ENV


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", required=True, help="mesh file (YAML)")
    p.add_argument("--grpc-port", type=int, help="the gRPC port sidecars get their config "
                   "from (ADS; default: control_plane.grpc_port)")  # fmt: skip
    p.add_argument("--admin-port", type=int, help="admin HTTP port (default: mesh file)")
    p.add_argument("--debounce", help="quiet time before a push, e.g. 100ms (default: mesh file)")
    p.add_argument("--token-file", help="file holding the bearer token for mutations (default: "
                   f"${TOKEN_ENV}, else a new one in a private file clients find)")  # fmt: skip
    p.add_argument("--grpc-host", default="127.0.0.1", help="the address of that port")
    p.add_argument("--state-dir", help="where state is kept across restarts: the mesh CA's "
                   f"root and join tokens, rollouts, quarantines (default: ${STATE_ENV}, else "
                   "$XDG_STATE_HOME/meshlm/MESHFILE-HASH, $XDG_STATE_HOME being "
                   "~/.local/state if unset; a .meshlm/ beside the mesh file that holds state "
                   "from an earlier version is used where it is)")  # fmt: skip
    p.add_argument("--rollout-store", help="rollout state file, kept across restarts "
                   "(default: rollouts.json in the state dir)")  # fmt: skip
    p.add_argument("--scaler", choices=("none", "local", "command"), default="none",
                   help="how the SLO loop's scale_out adds replicas: local starts `meshlm "
                   "serve` + its sidecar; command runs --scale-out/in-command")  # fmt: skip
    p.add_argument("--scale-out-command", help="prints the new replica's host:port last "
                   "(gets $MESHLM_SERVICE, $MESHLM_VERSION)")  # fmt: skip
    p.add_argument("--scale-in-command", help="stops the replica at $MESHLM_ENDPOINT")
    p.add_argument("--scaler-serve-args", default="",
                   help="extra `meshlm serve` arguments of a local scaler's replicas")  # fmt: skip
    p.add_argument("--isolation-store", help="quarantined request classes, kept across restarts "
                   "(default: isolation.json in the state dir)")  # fmt: skip
    r = p.add_argument_group("several control planes sharing one state store")
    r.add_argument("--store", help="shared state store: etcds://HOST:PORT[,HOST:PORT...][/ROOT]"
                   "?creds=DIR (TLS + etcd auth, as `meshlm etcd` prints it; or ca=, cert=, key=, "
                   "user=, password_file= FILE; the password else from $MESHLM_ETCD_PASSWORD), "
                   "etcd://... (plaintext, no auth: warned) (run several xds-servers on it) or "
                   "file:PATH; the mesh file seeds an empty store (default: none, one control "
                   "plane on its local files)")  # fmt: skip
    r.add_argument("--leader-ttl", type=float, default=30.0, help="seconds: the leader's "
                   "lease: a dead leader's successor leads within it (default 30)")  # fmt: skip
    r.add_argument("--replica-id", help="this replica's name (default: HOST-GRPC_PORT; with "
                   "--replicas: a prefix, default r: r1, r2...)")  # fmt: skip
    r.add_argument("--replicas", type=int, default=1, help="start this many replica processes "
                   f"on --store, replica i's gRPC and admin ports {REPLICA_PORT_STRIDE} * (i - 1) "
                   "above the first's; Ctrl-C stops them all")  # fmt: skip


# Replica i of --replicas listens REPLICA_PORT_STRIDE * i above the first: room for the ports a
# mesh CA takes after the ADS port (+2, +3) and the admin port beside it.
REPLICA_PORT_STRIDE = 10


def run(args: argparse.Namespace) -> int:
    from xds_server.admin import token as admin_token
    from xds_server.compose import Options, Process, StartError
    from xds_server.mesh import MeshError, load_yaml, parse_duration, parse_mesh

    if args.replicas != 1:
        from meshlm.replicas import launch_replicas

        return launch_replicas(args, REPLICA_PORT_STRIDE)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.scaler == "command" and not (args.scale_out_command and args.scale_in_command):
        print("meshlm xds-server: --scaler command needs --scale-out-command and "
              "--scale-in-command", file=sys.stderr)  # fmt: skip
        return 2
    if not args.leader_ttl > 0:  # NaN too
        print(f"meshlm xds-server: --leader-ttl: must be seconds > 0, got {args.leader_ttl}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        source = load_yaml(Path(args.mesh).read_text(), args.mesh)
        mesh = parse_mesh(source)
        debounce = parse_duration(args.debounce, "--debounce") if args.debounce else None
        token, token_note = os.environ.get(TOKEN_ENV), f"from ${TOKEN_ENV}"
        if args.token_file:
            token, token_note = (
                admin_token.read_token_file(args.token_file),
                f"from {args.token_file}",
            )
    except (OSError, MeshError, admin_token.TokenError) as e:
        print(f"meshlm xds-server: {e}", file=sys.stderr)
        return 2
    state, chosen = choose_state_dir(args.mesh, args.state_dir)
    try:  # it holds the CA's root key: private, as the dirs made inside it are
        state.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        print(f"meshlm xds-server: state dir {state}: {e.strerror or e}", file=sys.stderr)
        return 2
    options = Options(
        mesh=mesh,
        source=source,
        state=state,
        state_note=chosen,
        grpc_port=args.grpc_port,
        grpc_host=args.grpc_host,
        admin_port=args.admin_port,
        debounce=debounce,
        token=token,
        token_note=token_note,
        rollout_store=args.rollout_store,
        isolation_store=args.isolation_store,
        scaler=args.scaler,
        scale_out_command=args.scale_out_command,
        scale_in_command=args.scale_in_command,
        scaler_serve_args=args.scaler_serve_args,
        store=args.store,
        leader_ttl=args.leader_ttl,
        replica_id=args.replica_id,
    )
    process = Process(
        options,
        say=lambda line: print(line, flush=True),
        warn=lambda line: print(line, file=sys.stderr, flush=True),
    )
    try:
        process.start()
    except StartError as e:
        print(f"meshlm xds-server: {e}", file=sys.stderr)
        return e.code
    stop = termination_event()
    stop.wait()
    print("xds-server: stopping: closing the sidecars' ADS streams", flush=True)
    process.stop()
    print("xds-server: stopped", flush=True)
    return 0

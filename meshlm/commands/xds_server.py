"""`meshlm xds-server`: the control plane (ADS on gRPC, admin HTTP API) from a mesh file."""

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
    from xds_server.admin.api import AdminServer
    from xds_server.control_plane import ControlPlane
    from xds_server.mesh import MeshError, load_yaml, parse_duration, parse_mesh
    from xds_server.replica.serve import ReplicaRole, default_replica_id
    from xds_server.resources.tls import plaintext_warning
    from xds_server.rollout.api import RolloutAPI, spec_from_mesh
    from xds_server.rollout.controller import RolloutController
    from xds_server.rollout.sources import configured_sources
    from xds_server.slo.loop import SloLoops
    from xds_server.store import StoreError

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
    grpc_port = mesh.control_plane.grpc_port if args.grpc_port is None else args.grpc_port
    admin_port = mesh.control_plane.admin_port if args.admin_port is None else args.admin_port
    replica_id = args.replica_id or default_replica_id(grpc_port)
    # Replicas beside one mesh file keep their own local state (join tokens; quarantines are
    # shared through the store, the file is unused then): one file written by several
    # processes would keep only the last writer's.
    own = f"-{replica_id}" if args.store else ""
    state, chosen = choose_state_dir(args.mesh, args.state_dir)
    try:  # it holds the CA's root key: private, as the dirs made inside it are
        state.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        print(f"meshlm xds-server: state dir {state}: {e.strerror or e}", file=sys.stderr)
        return 2
    isolation = args.isolation_store or state / f"isolation{own}.json"
    try:
        replication = _replication(args, mesh, source, replica_id)
        # The mesh CA's root and join tokens (only with an `identity` block), 0700 / 0600.
        identity_dir = state / f"identity{own}"
        cp = ControlPlane(
            mesh,
            debounce=debounce,
            isolation_store=str(isolation),
            identity_dir=str(identity_dir),
            replication=replication,
        )
    except ValueError as e:  # an isolation store that is not ours, a CA root that cannot be read
        print(f"meshlm xds-server: {e}", file=sys.stderr)
        return 2
    try:
        cp.start(grpc_port, host=args.grpc_host)
    except (StoreError, ValueError) as e:  # the store did not answer, or holds no mesh
        print(f"meshlm xds-server: state store {args.store}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"meshlm xds-server: cannot listen on gRPC port {grpc_port}: {e}", file=sys.stderr)
        return 1
    try:
        admin = AdminServer(cp, token=token or admin_token.new_token(), port=admin_port)
    except OSError as e:
        cp.stop()
        reason = (e.strerror or str(e)).lower()
        print(
            f"meshlm xds-server: cannot listen on admin port {admin_port}: {reason}",
            file=sys.stderr,
        )
        return 1
    try:  # HTTPS (a mesh with identity): where local clients find the root to trust
        ca_file = admin.publish_ca()
    except (OSError, ValueError) as e:  # PrivateFileError: a run dir that is not private
        admin.stop()
        cp.stop()
        print(f"meshlm xds-server: cannot write the admin API's CA file: {e}", file=sys.stderr)
        return 1
    written = not token  # a token of our own, kept in a file only once every port is ours
    if written:
        try:
            path = admin_token.write_token(admin.port, admin.token)
        except (OSError, admin_token.TokenError) as e:
            admin.stop()
            cp.stop()
            print(f"meshlm xds-server: cannot write the admin token: {e}", file=sys.stderr)
            return 1
        token_note = f"written to {path} (mode 0600)"
    admin.start()
    scaler = _scaler(args, cp)

    def api(controller: RolloutController):  # -> RolloutAPI.handle
        return RolloutAPI(controller, lambda service: spec_from_mesh(cp.mesh, service)).handle

    def in_metrics(rollouts: RolloutController | None, slo: SloLoops | None) -> None:
        admin.metrics.rollouts, admin.metrics.slo = rollouts, slo  # in GET /metrics from now on

    role, restored = None, []
    rollout_file = Path(args.rollout_store or state / "rollouts.json")
    if replication is None:  # one control plane on its local files, as before issue 15
        rollout_file.parent.mkdir(parents=True, exist_ok=True)
        rollouts = RolloutController(cp, str(rollout_file), configured_sources(cp))
        slo = SloLoops(cp, scaler).start()
        admin.mounts["/slo"] = slo.handle
        admin.mounts["/rollouts"] = api(rollouts)
        admin.status = lambda: {"replica": None, "leading": True, "store": "local files"}
        in_metrics(rollouts, slo)
        restored = _restored(rollouts, mesh, rollout_file)
    else:  # one of several: the leader runs the rollouts and the SLO loop
        _import_rollouts(replication.store, rollout_file)
        role = ReplicaRole(
            replication.store,
            replica_id,
            cp,
            ttl=args.leader_ttl,
            info={"grpc": f"{args.grpc_host}:{cp.grpc_port}", "admin": admin.url},
            rollouts=lambda c, s: RolloutController(c, s, configured_sources(cp)),
            slo=lambda c, memory: SloLoops(c, scaler, memory=memory).start(),
            on_work=in_metrics,
        ).start()
        admin.mounts["/slo"] = role.slo_handler()
        admin.mounts["/rollouts"] = role.rollouts_handler(api)
        admin.status = role.status
        print(f"xds-server: replica {replica_id} on {args.store}, leader lease "
              f"{args.leader_ttl:g} s", flush=True)  # fmt: skip
    print(
        f"xds-server: incarnation {cp.incarnation}, ADS on {args.grpc_host}:{cp.grpc_port}, "
        f"admin on {admin.url} (token {token_note}"
        f"{f'; its CA in {ca_file}' if ca_file else ''}), debounce {cp.debounce * 1000:.0f} ms",
        flush=True,
    )
    print(f"xds-server: state in {state} ({chosen})", flush=True)
    for line in restored:
        print(f"xds-server: {line}", flush=True)
    trust = f" (HTTPS with the mesh CA: trust {ca_file}, see the README)" if ca_file else ""
    print(f"xds-server: dashboard at {admin.url}/dashboard/{trust}", flush=True)
    if warning := plaintext_warning(mesh):
        print(f"xds-server: warning: {warning}", file=sys.stderr, flush=True)
    if cp.identity:
        print(f"xds-server: mesh CA for {cp.identity.ca.trust_domain} on "
              f"{cp.identity.ca_address} (join tokens), {cp.identity.ca_mtls_address} "
              "(renewals)", flush=True)  # fmt: skip
    if cp.ads_mtls:
        print("xds-server: ADS over mTLS: sidecars need --identity (a certificate of this mesh)",
              flush=True)  # fmt: skip
    stop = termination_event()
    stop.wait()
    print("xds-server: stopping: closing the sidecars' ADS streams", flush=True)
    if role is not None:
        role.stop()
    else:
        rollouts.close()
        slo.stop()
    admin.stop()
    cp.stop()
    if written:
        admin_token.remove_token(admin.port, admin.token)
    print("xds-server: stopped", flush=True)
    return 0


def _restored(rollouts, mesh, path: Path) -> list[str]:  # rollouts: RolloutController
    """A line per rollout read back from `path`: a restart keeps its weights, not the file's."""

    def split(weights: dict[str, int]) -> str:
        return " ".join(f"{v}={w}" for v, w in weights.items())

    lines = []
    for service, r in sorted(rollouts.status().items()):
        svc = mesh.services.get(service)
        filed = f"; the mesh file says {split(svc.route.weights)}" if svc else ""
        lines.append(
            f"rollout {service} restored from {path}: {r['state']}, weights "
            f"{split(r['weights'])}{filed} (meshlm rollout status {service})"
        )
    return lines


def _import_rollouts(store, path: Path) -> None:
    """The rollouts of this mesh's single control plane, read once into an empty store."""
    from xds_server.replica.leader import import_rollouts
    from xds_server.store import StoreError
    from xds_server.store.state_file import RolloutStoreError

    if not path.exists():
        return
    try:
        if done := import_rollouts(store, path):
            print(f"xds-server: rollouts of {', '.join(done)} imported from {path} into the "
                  "store (the leader continues them)", flush=True)  # fmt: skip
    except (RolloutStoreError, StoreError) as e:
        print(f"xds-server: warning: rollouts in {path} not imported: {e}", file=sys.stderr,
              flush=True)  # fmt: skip


def _replication(args: argparse.Namespace, mesh, source, replica_id: str):
    """A replica's link to the store (None without --store); ValueError says what is wrong."""
    if not args.store:
        return None
    from xds_server.replica.replication import Replication
    from xds_server.store import open_store

    etcd = args.store.startswith(("etcd://", "etcds://"))
    if mesh.identity and not mesh.identity.root_cert_file and etcd:
        # Each replica would make a self-signed root of its own, and a sidecar enrolled by one
        # would not trust another. The CA's key stays out of etcd (whoever can read the store
        # would hold it): every replica is given the same root files and signs as an
        # intermediate of it.
        raise ValueError(
            "--store etcd:// with an identity block needs a root shared by every replica: "
            "identity.root: {cert_file, key_file} (the same files on each; each replica signs "
            "as an intermediate of it, and the root's key never goes to etcd)"
        )
    # The store's deadline under a third of the lease: a step-down is never later than that.
    store = open_store(args.store, timeout=min(2.0, args.leader_ttl / 3))
    return Replication(store, replica_id, source)


def _scaler(args: argparse.Namespace, cp):  # -> xds_server.slo.scaler.Scaler | None
    import shlex

    from xds_server.slo.scaler import CommandScaler, LocalScaler, control_plane_join_tokens

    if args.scaler == "local":  # its sidecars enrol with join tokens of cp's mesh CA
        return LocalScaler(
            f"127.0.0.1:{cp.grpc_port}",
            serve_args=shlex.split(args.scaler_serve_args),
            join_tokens=control_plane_join_tokens(cp),
        )
    if args.scaler == "command":
        return CommandScaler(args.scale_out_command, args.scale_in_command)
    return None

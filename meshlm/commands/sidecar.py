"""`meshlm sidecar`: one supervised Envoy next to one runtime (inbound) and/or for one caller
(outbound), configured by the control plane over ADS."""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys
from collections.abc import Callable

from meshlm.signals import termination_event


def _hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


def _ip(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an IP address, got {value!r}") from None


def _hostports(value: str) -> list[tuple[str, int]]:
    """HOST:PORT[,HOST:PORT...]: every control-plane replica."""
    return [_hostport(v.strip()) for v in value.split(",") if v.strip()] or [_hostport(value)]


def _default_node_id(args: argparse.Namespace) -> str:
    """`ROLE-HOST-PORT` (ROLE: SERVICE-VERSION or caller; PORT: its listener): unique on a host,
    since two sidecars cannot hold one port, and the same across restarts, so the last-known-good
    cache still finds this sidecar's config. The control plane refuses a second live stream
    with one id."""
    role = f"{args.service}-{args.version}" if args.service else "caller"
    port = args.inbound_port if args.inbound_port is not None else args.outbound_port
    return f"{role}-{socket.gethostname()}-{port}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--xds", type=_hostports, required=True, help="the control plane's gRPC "
                   "HOST:PORT (its --grpc-port, where sidecars get their config); several "
                   "control planes: each one's, comma-separated (Envoy fails over)")  # fmt: skip
    p.add_argument("--node-id", help="unique sidecar id (default: ROLE-HOST-PORT, "
                   "ROLE being SERVICE-VERSION or caller)")  # fmt: skip
    p.add_argument("--mesh", help="mesh file: --inbound-port defaults to the port of the "
                   "version's endpoint (callers reach a version through its sidecar)")  # fmt: skip
    p.add_argument("--service", help="the service whose runtime this sidecar fronts")
    p.add_argument("--version", help="the version of that service")
    p.add_argument("--inbound-port", type=int, help="listener in front of the local runtime, "
                   "for other workloads' sidecars (with --identity: mTLS from mesh workloads "
                   "only)")  # fmt: skip
    p.add_argument("--local-endpoint", help="the local runtime HOST:PORT")
    p.add_argument("--local-http-endpoint", help="the local runtime's OpenAI HTTP API "
                   "HOST:PORT (meshlm serve --http-port); the inbound listener routes /v1/ "
                   "there, with the same authz (default: none, /v1/ goes nowhere)")  # fmt: skip
    p.add_argument("--outbound-port", type=int, help="listener where local callers reach "
                   "mesh services (meshlm generate --target 127.0.0.1:PORT --authority "
                   "SERVICE)")  # fmt: skip
    p.add_argument("--listen-host", type=_ip, default="127.0.0.1", help="IP address the "
                   "listeners bind (0.0.0.0: reachable from other hosts or pods)")  # fmt: skip
    p.add_argument("--admin-port", type=int, default=0, help="Envoy's admin port, loopback "
                   "only (default: a free port)")  # fmt: skip
    p.add_argument("--stats-port", type=int, help="read-only Envoy stats (GET /stats, "
                   "/stats/prometheus; nothing else of the admin) on --listen-host:PORT, for "
                   "a control plane on another host that reads this caller's counters "
                   "(caller_sidecars[].admin_url http://HOST:PORT)")  # fmt: skip
    p.add_argument("--budget-port", type=int, help="a loopback listener where the local runtime "
                   "reaches the control plane's token budgets (meshlm serve --budget-service "
                   "127.0.0.1:PORT), over this sidecar's way to the control plane")  # fmt: skip
    p.add_argument("--xds-api", choices=("delta", "sotw"), default="delta", help="how config "
                   "changes arrive: delta (incremental xDS, the default) sends only the resources "
                   "that changed, and after a control plane restart nothing this sidecar already "
                   "holds; sotw (state of the world) resends each changed type whole")  # fmt: skip
    p.add_argument(
        "--delta", action="store_const", const="delta", dest="xds_api", help=argparse.SUPPRESS
    )  # the default now; kept for older command lines
    p.add_argument("--concurrency", type=int, default=1, help="Envoy worker threads")
    p.add_argument("--max-heap-mb", type=int, default=256, help="Envoy's memory limit: past it, "
                   "Envoy refuses new calls rather than run out of memory")  # fmt: skip
    p.add_argument("--lkg-file", help="where to keep the last config that "
                   "worked: the sidecar boots from it while the control plane is down")  # fmt: skip
    p.add_argument("--keys-file", help="native authz: the control plane's 0600 keys_file, "
                   "read at a last-known-good boot (default: --mesh authz.keys_file)")  # fmt: skip
    r = p.add_argument_group("registration: this host joins its service by itself")
    r.add_argument("--register", type=_hostport, metavar="ADDRESS:PORT", help="register this "
                   "host with the control plane once its runtime is SERVING (grpc.health.v1 on "
                   "--local-endpoint): ADDRESS:PORT is where callers reach the inbound listener "
                   "(its port is --inbound-port); health changes follow, and SIGTERM deregisters "
                   "before draining")  # fmt: skip
    r.add_argument(
        "--zone",
        help="the zone (locality) of this host: registered with --register; orders the "
        "zones this sidecar calls (a service's locality.failover)",
    )
    r.add_argument("--weight", type=int, help="with --register: this host's load-balancing "
                   "weight, 1..128")  # fmt: skip
    r.add_argument("--deregister-port", type=int, metavar="PORT", help="with --register: a "
                   "loopback HTTP port where POST /deregister takes this host out of its callers' "
                   "pools (answering once they hold it) while the sidecar keeps serving, so its "
                   "runtime can drain next: a Kubernetes preStop hook on the runtime "
                   "container")  # fmt: skip
    i = p.add_argument_group("workload identity: mTLS certificates from the mesh CA")
    i.add_argument("--identity", action="store_true", help="get this workload's certificate "
                   "from the mesh CA and renew it; every call to and from the sidecar, and its "
                   "config stream, then go over mTLS. Required by a control plane whose mesh "
                   "has an identity block")  # fmt: skip
    i.add_argument("--join-token-file", help="for the first certificate: the file `meshlm "
                   "identity token` wrote (0600); a bare name is looked for in the run dir's "
                   "join-tokens/ first, where that command puts it")  # fmt: skip
    i.add_argument("--identity-dir", help="private dir for the key, the certificate and the "
                   "socket Envoy reads them from "
                   "(default: the run dir's sidecar-NODE_ID)")  # fmt: skip
    i.add_argument("--cert-ttl", help="certificate lifetime to ask for, e.g. 15m (default and "
                   "most: the mesh's identity.cert_ttl)")  # fmt: skip


def _registration_problem(args: argparse.Namespace) -> str | None:
    if args.register is None:
        if args.weight is not None:
            return "--weight needs --register"
        if args.deregister_port is not None:
            return "--deregister-port needs --register (the registration it ends)"
        return None
    if not args.service or args.inbound_port is None:
        return "--register needs --service, --version and --inbound-port (the host it registers)"
    if args.register[1] != args.inbound_port:
        return (
            f"--register: port {args.register[1]} is not --inbound-port {args.inbound_port} "
            "(callers reach this host's inbound listener)"
        )
    host = args.register[0]
    if args.listen_host not in ("0.0.0.0", "::") and host != args.listen_host:
        return (
            f"--register: {host} is not where the inbound listener binds (--listen-host "
            f"{args.listen_host}): callers could not reach it; give --listen-host {host} or "
            "0.0.0.0"
        )
    if args.weight is not None and not 1 <= args.weight <= 128:
        return f"--weight: expected 1..128, got {args.weight}"
    return None


def _registration(args: argparse.Namespace, node_id: str, sv, agent):
    """Register this host once its runtime is SERVING and its sidecar holds its config: the
    started Registration, the runtime's health probe and the started DeregisterPort (or None),
    or None without --register."""
    if args.register is None:
        return None
    from sidecar.deregister_port import DeregisterPort
    from sidecar.registration import Registration, RuntimeHealth

    runtime = RuntimeHealth(args.local_endpoint)
    host, port = args.register
    registration = Registration(
        node_id,
        f"{host}:{port}",
        args.service,
        args.version,
        args.xds,
        lambda: sv.configured and runtime(),
        zone=args.zone,
        weight=args.weight,
        identity=agent,
        on_event=lambda msg: print(f"sidecar {node_id}: {msg}", flush=True),
    )
    runtime.watch(registration.wake)
    registration.start()
    hook = None
    if args.deregister_port is not None:
        hook = DeregisterPort(args.deregister_port, registration).start()
    return registration, runtime, hook


def native_keys(keys_file: str) -> Callable[[], dict[str, list[str]]]:
    """Reads tenant -> plaintext keys as the control plane does, at each use (keys rotate)."""
    from xds_server.resources.build import read_keys

    return lambda: read_keys(keys_file)


def _identity_agent(args: argparse.Namespace, node_id: str):  # -> IdentityAgent
    from sidecar.identity import IdentityAgent
    from xds_server.admin.token import run_dir
    from xds_server.mesh import parse_duration

    ttl = parse_duration(args.cert_ttl, "--cert-ttl") if args.cert_ttl else None
    state = args.identity_dir or run_dir() / f"sidecar-{node_id}"
    token = args.join_token_file
    if token:
        from meshlm.commands.identity import find_token_file

        token = find_token_file(token)
    return IdentityAgent(
        state,
        join_token_file=token,
        ttl=ttl,
        on_event=lambda msg: print(f"sidecar {node_id}: {msg}", flush=True),
    )


def run(args: argparse.Namespace) -> int:
    from mesh_common.ports import free_port
    from sidecar.bootstrap import ads_bootstrap
    from sidecar.lkg import LastKnownGood
    from sidecar.overload import with_overload_manager
    from sidecar.stats_listener import with_stats_listener
    from sidecar.supervisor import Supervisor

    if args.service and not args.version:
        print(f"meshlm sidecar: --service {args.service} needs --version (the version of it "
              "this sidecar fronts)", file=sys.stderr)  # fmt: skip
        return 2
    if args.mesh:
        from xds_server.mesh import MeshError, load_mesh

        try:
            mesh = load_mesh(args.mesh)
        except (OSError, MeshError) as e:
            print(f"meshlm sidecar: --mesh: {e}", file=sys.stderr)
            return 2
        if args.keys_file is None and mesh.authz.mode == "native":
            args.keys_file = mesh.authz.keys_file
        if args.inbound_port is None and args.service:
            try:
                version = mesh.services[args.service].versions[args.version]
            except KeyError:
                print(f"meshlm sidecar: --mesh: no {args.service}/{args.version} in {args.mesh}",
                      file=sys.stderr)  # fmt: skip
                return 2
            if version.endpoints:
                args.inbound_port = version.endpoints[0].port
    if args.register and args.inbound_port is None:
        args.inbound_port = args.register[1]
    if problem := _registration_problem(args):
        print(f"meshlm sidecar: {problem}", file=sys.stderr)
        return 2
    if args.inbound_port is None and args.outbound_port is None:
        print("meshlm sidecar: give --inbound-port and/or --outbound-port", file=sys.stderr)
        return 2
    if args.inbound_port is not None and not args.local_endpoint:
        print("meshlm sidecar: --inbound-port needs --local-endpoint", file=sys.stderr)
        return 2
    if args.local_http_endpoint and args.inbound_port is None:
        print("meshlm sidecar: --local-http-endpoint needs --inbound-port", file=sys.stderr)
        return 2
    if (args.join_token_file or args.identity_dir or args.cert_ttl) and not args.identity:
        print("meshlm sidecar: --join-token-file, --identity-dir and --cert-ttl need --identity",
              file=sys.stderr)  # fmt: skip
        return 2
    node_id = args.node_id or _default_node_id(args)
    try:
        agent = _identity_agent(args, node_id) if args.identity else None
    except ValueError as e:
        print(f"meshlm sidecar: {e}", file=sys.stderr)
        return 2
    admin_port = args.admin_port or free_port()
    try:
        boot = ads_bootstrap(
            node_id,
            xds_address=args.xds,
            service=args.service,
            version=args.version,
            inbound_port=args.inbound_port,
            outbound_port=args.outbound_port,
            local_endpoint=args.local_endpoint,
            local_http_endpoint=args.local_http_endpoint,
            listen_host=args.listen_host,
            host=f"{args.register[0]}:{args.register[1]}" if args.register else None,
            api_type="DELTA_GRPC" if args.xds_api == "delta" else "GRPC",
            admin_port=admin_port,
            zone=args.zone,
            budget_port=args.budget_port,
        )
        with_overload_manager(boot, max_heap_bytes=args.max_heap_mb * 2**20)
        if args.stats_port is not None:
            with_stats_listener(
                boot, host=args.listen_host, port=args.stats_port, admin_port=admin_port
            )
    except ValueError as e:
        print(f"meshlm sidecar: {e}", file=sys.stderr)
        return 2
    stop = termination_event()
    sv = Supervisor(
        node_id,
        boot,
        args.xds,  # any replica that answers will do (the supervisor probes them in turn)
        lkg=LastKnownGood(args.lkg_file),
        concurrency=args.concurrency,
        on_event=lambda msg: print(f"sidecar {node_id}: {msg}", flush=True),
        on_fatal=lambda _msg: stop.set(),
        keys=native_keys(args.keys_file) if args.keys_file else None,
        identity=agent,
    )
    sv.start()
    try:
        registered = _registration(args, node_id, sv, agent)
    except OSError as e:  # the --deregister-port is taken
        print(f"meshlm sidecar: --deregister-port {args.deregister_port}: {e}", file=sys.stderr)
        sv.stop()
        return 2
    stop.wait()
    if registered is not None:
        registration, runtime, hook = registered
        registration.deregister()  # out of the callers' EDS before the listeners close
        runtime.close()
        if hook is not None:
            hook.stop()
    if not sv.failed:
        print(f"sidecar {node_id}: draining: the listeners take no new connections, open calls "
              "finish, then envoy stops", flush=True)  # fmt: skip
    sv.stop()
    if sv.failed:
        print(f"meshlm sidecar: {sv.failed}", file=sys.stderr)
        return 1
    print(f"sidecar {node_id}: stopped", flush=True)
    return 0

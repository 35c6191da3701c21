"""One `meshlm xds-server` process, built and run from its options: the composition root.

`Process.start()` builds every part by constructor arguments and starts them in order:

  1. the link to the shared state store, when there is one (`Replication`)
  2. the control plane and its gRPC port (`build_server`: the snapshot cache, sync status and
     isolation controller; ADS, rate limits, access logs, health, CSDS and workload
     registration on the port; the mesh CA; the debouncer; `XdsServer` runs them, the push
     loops and the port's renewal)
  3. the admin API (`AdminServer`) with its metrics, dashboard and mounts, its CA file and
     token file
  4. the leader's work: rollouts and the SLO loop on their local files (`LocalWork`), or, for a
     replica, the election that runs them on the leader only (`ReplicaRole`)

`stop()` stops them in reverse. The CLI (meshlm/commands/xds_server.py) reads the flags, the mesh
file and the token, and calls this; what goes wrong here is a StartError carrying its exit status.
"""

from __future__ import annotations

import shlex
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from xds_server import mesh as m
from xds_server.admin import token as admin_token
from xds_server.admin.api import AdminServer, Mount
from xds_server.admin.dashboard.service import Dashboard
from xds_server.admin.metrics import ControlPlaneMetrics
from xds_server.control_plane import new_incarnation
from xds_server.identity.workload import Identity
from xds_server.ratelimit import budgets
from xds_server.ratelimit import service as ratelimit
from xds_server.registry import service as registration
from xds_server.registry.journal import RegistrationFile
from xds_server.registry.store import StoreRegistry
from xds_server.registry.table import Registry
from xds_server.replica.leader import import_rollouts
from xds_server.replica.replication import Replication
from xds_server.replica.serve import ReplicaRole, default_replica_id
from xds_server.resources import tls
from xds_server.rollout.api import RolloutAPI, spec_from_mesh
from xds_server.rollout.controller import RolloutController
from xds_server.rollout.sources import configured_sources
from xds_server.server import Debouncer, GrpcService, XdsServer
from xds_server.slo import access_log_service as accesslog
from xds_server.slo.loop import SloLoops
from xds_server.slo.quarantine import Isolation
from xds_server.slo.scaler import (
    CommandScaler,
    LocalScaler,
    Scaler,
    control_plane_join_tokens,
)
from xds_server.store import StoreError, open_store
from xds_server.store.state_file import RolloutStoreError
from xds_server.xds import csds, health
from xds_server.xds.ads import AdsServicer
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.sync import Limits, SyncStatus

Say = Callable[[str], None]
# GET / on a control plane alone on its local files.
LOCAL_STATUS = {"replica": None, "leading": True, "store": "local files"}


class StartError(Exception):
    """A part could not be built or started; `code` is the process's exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Options:
    """What the flags say, read and checked (xds_server never reads argv)."""

    mesh: m.Mesh
    source: Any  # the document `mesh` parsed from: it seeds an empty store
    state: Path  # the state dir, made and private
    state_note: str = ""  # why that dir
    grpc_port: int | None = None  # None: the mesh file's
    grpc_host: str = "127.0.0.1"
    admin_port: int | None = None  # None: the mesh file's
    debounce: float | None = None  # None: the mesh file's
    token: str | None = None  # None: a new one, written to the run dir
    token_note: str = ""  # where the token came from
    rollout_store: str | None = None
    isolation_store: str | None = None
    scaler: str = "none"  # none, local or command
    scale_out_command: str | None = None
    scale_in_command: str | None = None
    scaler_serve_args: str = ""
    store: str | None = None  # the shared state store's URL; None: one control plane alone
    leader_ttl: float = 30.0
    replica_id: str | None = None


def build_server(
    mesh: m.Mesh,
    *,
    debounce: float | None = None,
    incarnation: str | None = None,
    limits: Limits | None = None,
    isolation_store: str | None = None,
    identity_dir: str | None = None,
    replication: Replication | None = None,
    registrations_file: str | None = None,
) -> XdsServer:
    """The control plane of `mesh` and every service on its gRPC port; nothing is bound until
    its start(). `debounce`: seconds of quiet before a push (default: the mesh's).
    `isolation_store`: the quarantines kept across restarts (None: in memory). `identity_dir`:
    where the mesh CA keeps its root and join tokens, a private dir (None: in memory); the CA
    runs only when the mesh has an `identity` block. `replication`: this control plane is one
    replica of several sharing a store, which holds the registrations too.
    `registrations_file`: where a control plane alone keeps them across restarts (None: in
    memory)."""
    # Quarantined request classes restored from their store are in the very first snapshot,
    # so a restart leaves no window of unprotected traffic.
    isolation = Isolation(lambda: cache.mesh, isolation_store)
    mesh = isolation.overlay(mesh)
    # Registrations: on the store for replicas (read before the first stage); else saved to
    # the state dir and, after a restart, held for the grace period: in the first snapshot, so
    # callers keep live hosts while their sidecars register again.
    if replication is not None:
        registry: Registry = StoreRegistry(replication.store, replication.id, lambda: cache.mesh)
    elif registrations_file is not None:
        journal = RegistrationFile(registrations_file)
        registry = Registry(journal=journal)
        registry.restore(journal.load(mesh), mesh, lambda: server.push_registrations())
        mesh = registry.overlay(mesh)
    else:
        registry = Registry()
    cache = SnapshotCache(mesh, incarnation or new_incarnation())
    members_changed = threading.Event()  # a sidecar came or went: rate-limit shares to re-divide
    sync = SyncStatus(
        cache.expected_generations,
        cache.generation_of,
        limits or Limits(lagging_after=mesh.control_plane.lagging_after),
        retain_groups=cache.retain,
        membership_changed=members_changed.set,
    )
    delay = mesh.control_plane.debounce if debounce is None else debounce
    # ADS, and the rate-limit and access-log services on its port, over mTLS with identity.
    mtls = tls.mtls(mesh)
    td = mesh.identity.trust_domain if mtls else None
    server: XdsServer  # its health service answers from it

    def serving() -> bool:
        return server.serving

    token_budgets = budgets.TokenBudgetServicer(lambda: cache.mesh, trust_domain=td)
    services = [
        GrpcService(
            ratelimit.add_to_server,
            ratelimit.RateLimitServicer(lambda: cache.mesh, trust_domain=td),
        ),
        GrpcService(budgets.add_to_server, token_budgets),
        GrpcService(accesslog.add_to_server, accesslog.AccessLogServicer(isolation)),
        GrpcService(health.add_to_server, health.HealthServicer(serving)),
        GrpcService(csds.add_to_server, csds.CsdsServicer(cache, sync)),
        GrpcService(
            registration.add_to_server,
            registration.RegistryServicer(
                registry,
                lambda: cache.mesh,
                lambda: server.push_registrations(),
                trust_domain=td,
            ),
        ),
    ]
    server = XdsServer(
        cache,
        sync,
        isolation,
        ads=AdsServicer(cache, sync, td),
        services=services,
        debouncer=Debouncer(cache.publish, delay),
        members_changed=members_changed,
        identity=Identity(mesh.identity, identity_dir) if mesh.identity else None,
        mtls=mtls,
        replication=replication,
        registry=registry,
        token_budgets=token_budgets,
    )
    return server


class LocalWork:
    """Rollouts and the SLO loop of a control plane alone on its local files: it always leads."""

    def __init__(self, rollouts: RolloutController, slo: SloLoops) -> None:
        self.rollouts, self.slo = rollouts, slo

    def current(self) -> tuple[RolloutController, SloLoops]:
        return self.rollouts, self.slo

    def rollouts_handler(self, api: Callable[[RolloutController], Mount]) -> Mount:
        return api(self.rollouts)

    def slo_handler(self) -> Mount:
        return self.slo.handle

    def status(self) -> dict[str, Any]:
        return dict(LOCAL_STATUS)

    def stop(self) -> None:
        self.rollouts.close()
        self.slo.stop()


class Process:
    """Every part of one control plane process; `start()` then `stop()`."""

    def __init__(self, options: Options, *, say: Say = print, warn: Say | None = None) -> None:
        """`say(line)` for what a person starting it reads, `warn(line)` for warnings (default:
        standard error)."""
        self.options = options
        self._say = say
        self._warn = warn or (lambda line: print(line, file=sys.stderr))
        self.server: XdsServer | None = None
        self.admin: AdminServer | None = None
        self.work: LocalWork | ReplicaRole | None = None
        self._mounts: dict[str, Mount] = {}  # the leader's work's, once it exists
        self._token_written = False
        self._token_note = options.token_note

    # -- start, in order ------------------------------------------------------------------------
    def start(self) -> Process:
        """Build and start every part; StartError (having stopped what had started) if one
        cannot be."""
        o = self.options
        mesh = o.mesh
        grpc_port = mesh.control_plane.grpc_port if o.grpc_port is None else o.grpc_port
        admin_port = mesh.control_plane.admin_port if o.admin_port is None else o.admin_port
        replica_id = o.replica_id or default_replica_id(grpc_port)
        # Replicas beside one mesh file keep their own local state (join tokens; quarantines
        # are shared through the store, the file is unused then): one file written by several
        # processes would keep only the last writer's.
        own = f"-{replica_id}" if o.store else ""
        isolation = o.isolation_store or o.state / f"isolation{own}.json"
        try:
            replication = self._replication(replica_id)
            # The mesh CA's root and join tokens (only with an `identity` block), 0700 / 0600.
            server = build_server(
                mesh,
                debounce=o.debounce,
                isolation_store=str(isolation),
                identity_dir=str(o.state / f"identity{own}"),
                replication=replication,
                # (a dir of its own, made private, whatever the state dir's mode)
                registrations_file=None
                if o.store
                else str(o.state / "registrations" / "hosts.json"),
            )
        except ValueError as e:  # an isolation store not ours, a CA root that cannot be read
            raise StartError(str(e), 2) from None
        try:
            server.start(grpc_port, host=o.grpc_host)
        except (StoreError, ValueError) as e:  # the store did not answer, or holds no mesh
            raise StartError(f"state store {o.store}: {e}", 1) from None
        except OSError as e:
            raise StartError(f"cannot listen on gRPC port {grpc_port}: {e}", 1) from None
        self.server = server
        ca_file = self._start_admin(server, admin_port)
        admin = self.admin
        scaler = self._scaler(server)
        restored: list[str] = []
        rollout_file = Path(o.rollout_store or o.state / "rollouts.json")
        sources = configured_sources(server)
        if replication is None:
            rollout_file.parent.mkdir(parents=True, exist_ok=True)
            rollouts = RolloutController(server, str(rollout_file), sources)
            self.work = LocalWork(rollouts, SloLoops(server, scaler).start())
            restored = _restored(rollouts, mesh, rollout_file)
        else:  # one of several: the leader runs the rollouts and the SLO loop
            self._import_rollouts(replication, rollout_file)
            self.work = ReplicaRole(
                replication.store,
                replica_id,
                server,
                ttl=o.leader_ttl,
                info={"grpc": f"{o.grpc_host}:{server.grpc_port}", "admin": admin.url},
                rollouts=lambda c, s: RolloutController(c, s, sources),
                slo=lambda c, memory: SloLoops(c, scaler, memory=memory).start(),
            ).start()
            self._say(
                f"xds-server: replica {replica_id} on {o.store}, leader lease {o.leader_ttl:g} s"
            )
        self._mounts = {
            "/slo": self.work.slo_handler(),
            "/rollouts": self.work.rollouts_handler(self._rollout_api),
        }
        self._banner(ca_file, restored)
        return self

    def _replication(self, replica_id: str) -> Replication | None:
        """A replica's link to the store (None without one); ValueError says what is wrong."""
        o = self.options
        if not o.store:
            return None
        etcd = o.store.startswith(("etcd://", "etcds://"))
        if o.mesh.identity and not o.mesh.identity.root_cert_file and etcd:
            # Each replica would make a self-signed root of its own, and a sidecar enrolled by
            # one would not trust another. The CA's key stays out of etcd (whoever can read the
            # store would hold it): every replica is given the same root files and signs as an
            # intermediate of it.
            raise ValueError(
                "--store etcd:// with an identity block needs a root shared by every replica: "
                "identity.root: {cert_file, key_file} (the same files on each; each replica "
                "signs as an intermediate of it, and the root's key never goes to etcd)"
            )
        # The store's deadline under a third of the lease: a step-down is never later than that.
        store = open_store(o.store, timeout=min(2.0, o.leader_ttl / 3))
        return Replication(store, replica_id, o.source)

    def _start_admin(self, server: XdsServer, admin_port: int) -> Path | None:
        """Bind the admin API, publish its CA (HTTPS) and its token (one of our own), start it;
        the CA file's path, if any."""
        token = self.options.token
        try:
            admin = AdminServer(
                server,
                token=token or admin_token.new_token(),
                port=admin_port,
                mounts={"/slo": self._mounted("/slo"), "/rollouts": self._mounted("/rollouts")},
                status=self._status,
                metrics=ControlPlaneMetrics(server, self._current),
                dashboard=Dashboard(server, self._current),
                # Replicas refuse admin faults (their store does not hold them yet).
                faults_file=None if self.options.store else self.options.state / "faults.json",
            )
        except OSError as e:
            server.stop()
            reason = (e.strerror or str(e)).lower()
            raise StartError(f"cannot listen on admin port {admin_port}: {reason}", 1) from None
        try:  # HTTPS (a mesh with identity): where local clients find the root to trust
            ca_file = admin.publish_ca()
        except (OSError, ValueError) as e:  # PrivateFileError: a run dir that is not private
            admin.stop()
            server.stop()
            raise StartError(f"cannot write the admin API's CA file: {e}", 1) from None
        if not token:  # a token of our own, kept in a file only once every port is ours
            try:
                path = admin_token.write_token(admin.port, admin.token)
            except (OSError, admin_token.TokenError) as e:
                admin.stop()
                server.stop()
                raise StartError(f"cannot write the admin token: {e}", 1) from None
            self._token_written = True
            self._token_note = f"written to {path} (mode 0600)"
        self.admin = admin.start()
        return ca_file

    def _scaler(self, server: XdsServer) -> Scaler | None:
        o = self.options
        if o.scaler == "local":  # its sidecars enrol with join tokens of the server's mesh CA
            return LocalScaler(
                f"127.0.0.1:{server.grpc_port}",
                serve_args=shlex.split(o.scaler_serve_args),
                join_tokens=control_plane_join_tokens(server),
            )
        if o.scaler == "command":
            return CommandScaler(o.scale_out_command, o.scale_in_command)
        return None

    def _import_rollouts(self, replication: Replication, path: Path) -> None:
        """The rollouts of this mesh's single control plane, read once into an empty store."""
        if not path.exists():
            return
        try:
            if done := import_rollouts(replication.store, path):
                self._say(
                    f"xds-server: rollouts of {', '.join(done)} imported from {path} into the "
                    "store (the leader continues them)"
                )
        except (RolloutStoreError, StoreError) as e:
            self._warn(f"xds-server: warning: rollouts in {path} not imported: {e}")

    def _banner(self, ca_file: Path | None, restored: list[str]) -> None:
        o, server, admin = self.options, self.server, self.admin
        self._say(
            f"xds-server: incarnation {server.incarnation}, ADS on {o.grpc_host}:"
            f"{server.grpc_port}, admin on {admin.url} (token {self._token_note}"
            f"{f'; its CA in {ca_file}' if ca_file else ''}), debounce "
            f"{server.debounce * 1000:.0f} ms"
        )
        self._say(f"xds-server: state in {o.state} ({o.state_note})")
        for line in restored:
            self._say(f"xds-server: {line}")
        trust = f" (HTTPS with the mesh CA: trust {ca_file}, see the README)" if ca_file else ""
        self._say(f"xds-server: dashboard at {admin.url}/dashboard/{trust}")
        if warning := tls.plaintext_warning(o.mesh):
            self._warn(f"xds-server: warning: {warning}")
        if server.identity:
            self._say(
                f"xds-server: mesh CA for {server.identity.ca.trust_domain} on "
                f"{server.identity.ca_address} (join tokens), "
                f"{server.identity.ca_mtls_address} (renewals)"
            )
        if server.ads_mtls:
            self._say(
                "xds-server: ADS over mTLS: sidecars need --identity (a certificate of this mesh)"
            )

    # -- the admin API's view of the leader's work ----------------------------------------------
    def _rollout_api(self, controller: RolloutController) -> Mount:
        server = self.server
        return RolloutAPI(controller, lambda service: spec_from_mesh(server.mesh, service)).handle

    def _mounted(self, prefix: str) -> Mount:
        """The admin route to the leader's work under `prefix`: 404 until that work exists."""

        def handle(method: str, target: str, body: bytes = b"") -> tuple[int, Any]:
            mount = self._mounts.get(prefix)
            if mount is None:
                return 404, {"error": f"no such endpoint: {method} {urlsplit(target).path}"}
            return mount(method, target, body)

        return handle

    def _status(self) -> dict[str, Any]:
        """GET /: which replica this is and which leads."""
        if self.work is None:  # a replica's election is made right after the admin API starts
            return dict(LOCAL_STATUS) if not self.options.store else {"replica": None}
        return self.work.status()

    def _current(self) -> tuple[Any, Any]:
        return self.work.current() if self.work is not None else (None, None)

    # -- stop, in reverse -----------------------------------------------------------------------
    def stop(self) -> None:
        if self.work is not None:
            self.work.stop()
        if self.admin is not None:
            self.admin.stop()
        if self.server is not None:
            self.server.stop()
        if self._token_written:
            admin_token.remove_token(self.admin.port, self.admin.token)


def _restored(rollouts: RolloutController, mesh: m.Mesh, path: Path) -> list[str]:
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

"""`meshlm.registry.v1.Registry/Register` on the control plane's gRPC port: a host registers
itself for as long as its stream lives (mesh_common/registry_wire.py has the messages).

Trust: where the port is mTLS (an identity block, `mtls: strict`) registration is on unless the
mesh turns it off, and a registration is believed only for the service whose `service_account`
the caller's certificate holds; on a plaintext port it is off unless
`control_plane.registration.enabled: true`, which trusts whoever reaches the port. Replicas on a
store share the registrations through it (registry/store.py): a host may register on any.

Each change (a host joins, changes health, deregisters, or its grace period ends) restages the
live mesh like any other change (`apply`), and the answer waits until the callers' sidecars
hold it: a sidecar that deregisters before it drains is out of every caller's EDS before its
listeners close, so no call is sent to a closing host.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from mesh_common import registry_wire as wire
from xds_server import mesh as m
from xds_server.registry import request as rq
from xds_server.registry.request import Refused
from xds_server.registry.table import Entry, Registry
from xds_server.xds.peer import Peer, workload

log = logging.getLogger("meshlm.registry")

FIRST_MESSAGE_TIMEOUT = 10.0  # seconds a new stream has to register
WARNINGS_PER_SECOND = 10  # refusals logged as warnings; past it, one line counts the rest


class Applied(Protocol):
    """What a restage answers (ControlPlane's ApplyResult): its version, and whether every
    affected sidecar ACKed it in time."""

    version: str
    ok: bool


def add_to_server(server: grpc.aio.Server, servicer: RegistryServicer) -> None:
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                wire.SERVICE,
                {wire.METHOD: grpc.stream_stream_rpc_method_handler(servicer.register)},
            )
        ]
    )


class RegistryServicer:
    def __init__(
        self,
        registry: Registry,
        mesh: Callable[[], m.Mesh],
        apply: Callable[[], Applied],
        *,
        trust_domain: str | None,
        first_message_timeout: float = FIRST_MESSAGE_TIMEOUT,
    ) -> None:
        """`mesh()` is the live desired state; `apply()` restages it with the registry's hosts
        and waits (bounded) for the ACKs, in a worker thread. `trust_domain`: the gRPC port is
        mTLS and callers' certificates are of this domain (None: plaintext)."""
        self.registry = registry
        self._mesh = mesh
        self._apply = apply
        self.trust_domain = trust_domain
        self.first_message_timeout = first_message_timeout
        self._tokens = itertools.count(1)
        self._second = 0  # the monotonic second of the last refusal, and its warnings
        self._warned = 0
        self._unlogged = 0

    async def register(self, _requests: Any, context: grpc.aio.ServicerContext) -> None:
        token = next(self._tokens)
        node, peer = "", None
        owned = False
        try:
            raw = await self._first(context)
            if raw is None:
                return
            node = rq.claimed_node(raw)
            msg = rq.parse(raw, self._mesh())
            if not isinstance(msg, rq.Register):
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "message: the first message of a stream is {register: {...}}",
                )
            node = msg.node_id
            peer = self._peer(context)
            self._check_allowed(msg, peer)
            owned = True  # from here the stream's end is its host's loss (none if refused)
            entry = await self._table(
                self.registry.add,
                msg,
                token=token,
                spiffe_id=peer.spiffe_id if peer else None,
                mesh=self._mesh(),
            )
            log.info(
                "registered %s for %s/%s (node %s, %s)",
                msg.endpoint,
                msg.service,
                msg.version,
                node,
                peer.spiffe_id if peer else "no identity",
            )
            await context.write(await self._answer("registered", entry))
            while True:
                raw = await context.read()
                if raw is grpc.aio.EOF:
                    return
                msg = rq.parse(raw, self._mesh())
                if isinstance(msg, rq.Register):
                    raise Refused(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        "register: this stream registered already (one host per stream)",
                    )
                if isinstance(msg, rq.Health):
                    entry = await self._table(self.registry.set_health, token, msg.serving)
                    if entry is None:
                        owned = False
                        raise _taken_over()
                    await context.write(await self._answer("health", entry))
                    continue
                entry = await self._table(self.registry.remove, token)  # Deregister
                owned = False
                if entry is not None:
                    log.info("deregistered %s (node %s)", entry.reg.endpoint, node)
                await context.write(await self._answer("deregistered", entry))
                return
        except Refused as r:
            self._refused(node, peer, context, r)
            await context.abort(r.code, r.message)
        finally:
            if owned:
                self._lost(token)

    async def _table(self, change: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A change of the registry, off the event loop where it waits on I/O (a journal, a
        store)."""
        if not self.registry.blocking:
            return change(*args, **kwargs)
        done = asyncio.ensure_future(asyncio.to_thread(change, *args, **kwargs))
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            # The stream ended meanwhile, but the change lands all the same: let it, so the
            # stream's cleanup sees the host it registered (and starts its grace period).
            with contextlib.suppress(Exception):
                await done
            raise

    async def _first(self, context: grpc.aio.ServicerContext) -> bytes | None:
        try:
            raw = await asyncio.wait_for(context.read(), self.first_message_timeout)
        except TimeoutError:
            raise Refused(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"register: none within {self.first_message_timeout:g}s of opening the stream",
            ) from None
        return None if raw is grpc.aio.EOF else raw

    def _peer(self, context: grpc.aio.ServicerContext) -> Peer | None:
        if self.trust_domain is None:
            return None
        peer = workload(context, self.trust_domain)
        if peer is None:
            raise Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                f"register: needs a client certificate with one workload SPIFFE ID of trust "
                f"domain {self.trust_domain} (meshlm sidecar --identity)",
            )
        return peer

    def _check_allowed(self, reg: rq.Register, peer: Peer | None) -> None:
        mesh = self._mesh()
        enabled = mesh.control_plane.registration.enabled
        if enabled is False:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "register: registration is off (control_plane.registration.enabled: false)",
            )
        if enabled is None and self.trust_domain is None:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "register: registration is off on a plaintext control plane, where anyone who "
                "reaches its gRPC port could add hosts: give the mesh an identity block (mTLS), "
                "or trust the port with control_plane.registration.enabled: true",
            )
        if peer is not None:
            account = mesh.services[reg.service].service_account
            if peer.service_account != account:
                raise Refused(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"register.service: {reg.service} runs as service account {account}, but "
                    f"this caller is {peer.spiffe_id}",
                )

    async def _answer(self, kind: str, entry: Entry | None) -> bytes:
        """The reply to one change, once the callers hold it (or the wait ran out)."""
        applied = await self._restage()
        body: dict[str, Any] = {
            "version_info": applied.version if applied else None,
            "acked": bool(applied and applied.ok),
        }
        if entry is not None:
            body.update(address=str(entry.reg.endpoint), health=entry.to_json()["health"])
        return json.dumps({kind: body}).encode()

    def _lost(self, token: int) -> None:
        """The stream ended unannounced: the host stays for the grace period, then goes."""
        entry = self.registry.lose(token)
        if entry is None:
            return
        grace = self._mesh().control_plane.registration.grace
        log.warning(
            "registration stream of %s (node %s) ended without deregistering: removed in %gs "
            "unless it registers again",
            entry.reg.endpoint,
            entry.reg.node_id,
            grace,
        )
        loop = asyncio.get_running_loop()
        loop.call_later(grace, lambda: loop.create_task(self._expire(token)))

    async def _expire(self, token: int) -> None:
        entry = self.registry.expire(token)
        if entry is not None:
            log.warning(
                "registration of %s (node %s) expired", entry.reg.endpoint, entry.reg.node_id
            )
            await self._restage()

    async def _restage(self) -> Applied | None:
        """`apply()` in a worker thread (it waits for ACKs); None when nothing was staged."""
        try:
            return await asyncio.to_thread(self._apply)
        except ValueError as e:  # a sidecar group that cannot take the mesh: nothing staged
            log.warning("registration change not staged: %s", e)
            return None

    def _refused(
        self, node: str, peer: Peer | None, context: grpc.aio.ServicerContext, r: Refused
    ) -> None:
        # A flood of bad registrations must not flood the log: a few warnings a second, and
        # the next one says how many were not logged.
        self.registry.refused += 1
        second = int(time.monotonic())
        if second != self._second:
            self._second, self._warned = second, 0
        if self._warned >= WARNINGS_PER_SECOND:
            self._unlogged += 1
            return
        self._warned += 1
        unlogged, self._unlogged = self._unlogged, 0
        who = peer.spiffe_id if peer else _certificate_id(context, self.trust_domain)
        log.warning(
            "registration refused (%s): node %r, %s, from %s: %s%s",
            r.code.name,
            node or "?",
            who,
            context.peer(),
            r.message,
            f" ({unlogged} refusals before this one not logged)" if unlogged else "",
        )


def _taken_over() -> Refused:
    return Refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        "register: this host was registered again on a newer stream, which owns it now",
    )


def _certificate_id(context: grpc.aio.ServicerContext, trust_domain: str | None) -> str:
    if trust_domain is None:
        return "no identity (plaintext port)"
    peer = workload(context, trust_domain)
    return peer.spiffe_id if peer else "no workload certificate"

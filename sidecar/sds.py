"""SDS for one sidecar's Envoy, served by its own supervisor on a unix socket.

Istio's shape: the sidecar's agent (sidecar/identity.py) holds the workload's key and serves it to
its Envoy over Envoy's Secret Discovery Service (`envoy.service.secret.v3`), secret `default`
(certificate chain + key) and `ROOTCA` (the trust bundle: old and new roots during a root
rotation). A local socket, not the ADS stream: the private key is made by this process and never
leaves the sidecar's host and private dir (over ADS the control plane would have to hold every
workload's key); and Envoy gets its certificate, and renewals of it, from the agent while the
control plane is down (a sidecar restarted then boots with its persisted certificate). The
socket lives in the sidecar's private run dir (0700), so only this user can ask for the key.

State of the world per stream (`StreamSecrets`): Envoy asks for names, gets every one we hold
under one version, ACKs; a new certificate is pushed to each stream as a new version.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import grpc
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from mesh_common import type_urls
from mesh_common.loop_thread import LoopThread
from mesh_common.sds_names import DEFAULT, ROOTCA, SDS_CLUSTER

log = logging.getLogger("meshlm.sidecar.sds")

MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the NUL


def sds_config() -> dict[str, Any]:
    """The `sds_config` of a transport socket that reads secrets from this server."""
    return {
        "resource_api_version": "V3",
        "api_config_source": {
            "api_type": "GRPC",
            "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": SDS_CLUSTER}}],
        },
    }


def secret_ref(name: str) -> dict[str, Any]:
    """`{name, sds_config}`: an item of a TLS context's `tls_certificate_sds_secret_configs`,
    or its `validation_context_sds_secret_config`."""
    return {"name": name, "sds_config": sds_config()}


class SecretStore:
    """The secrets of one workload, versioned; writers from any thread, readers in the loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version = 0
        self._secrets: dict[str, secret_pb2.Secret] = {}
        self._listeners: list[Any] = []

    def set(self, chain_pem: bytes, key_pem: bytes, bundle_pem: bytes) -> None:
        default = secret_pb2.Secret(name=DEFAULT)
        default.tls_certificate.certificate_chain.inline_bytes = chain_pem
        default.tls_certificate.private_key.inline_bytes = key_pem
        rootca = secret_pb2.Secret(name=ROOTCA)
        rootca.validation_context.trusted_ca.inline_bytes = bundle_pem
        with self._lock:
            self._version += 1
            self._secrets = {DEFAULT: default, ROOTCA: rootca}
            listeners = list(self._listeners)
        for notify in listeners:
            notify()

    def snapshot(self) -> tuple[int, dict[str, secret_pb2.Secret]]:
        with self._lock:
            return self._version, self._secrets

    def subscribe(self, notify: Any) -> None:
        with self._lock:
            self._listeners.append(notify)

    def unsubscribe(self, notify: Any) -> None:
        with self._lock:
            self._listeners.remove(notify)


class _Servicer(sds_pb2_grpc.SecretDiscoveryServiceServicer):
    def __init__(self, store: SecretStore, loop: asyncio.AbstractEventLoop) -> None:
        self.store = store
        self.loop = loop

    async def StreamSecrets(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        events: asyncio.Queue[Any] = asyncio.Queue()

        def changed() -> None:
            self.loop.call_soon_threadsafe(events.put_nowait, "changed")

        async def read() -> None:
            try:
                async for req in request_iterator:
                    await events.put(req)
            finally:
                await events.put(None)

        reader = asyncio.create_task(read())
        self.store.subscribe(changed)
        names: list[str] = []
        sent: tuple[int, tuple[str, ...]] | None = None
        nonce = 0
        try:
            while True:
                ev = await events.get()
                if ev is None:
                    return
                if isinstance(ev, discovery_pb2.DiscoveryRequest):
                    if ev.type_url != type_urls.SECRET:
                        await context.abort(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"type_url: expected {type_urls.SECRET}, got {ev.type_url!r}",
                        )
                    if ev.HasField("error_detail"):  # a NACK: keep the stream, say why
                        log.warning(
                            "envoy refused secrets version %s: %s",
                            ev.version_info,
                            ev.error_detail.message,
                        )
                        continue
                    names = list(ev.resource_names)
                version, secrets = self.store.snapshot()
                want = (version, tuple(names))
                if not names or not secrets or want == sent:
                    continue  # nothing asked, nothing held yet, or the ACK of what we sent
                nonce += 1
                resp = discovery_pb2.DiscoveryResponse(
                    version_info=str(version), type_url=type_urls.SECRET, nonce=str(nonce)
                )
                for n in names:
                    if n in secrets:
                        resp.resources.add().Pack(secrets[n])
                sent = want
                yield resp
        finally:
            self.store.unsubscribe(changed)
            reader.cancel()

    async def FetchSecrets(
        self, request: discovery_pb2.DiscoveryRequest, context: grpc.aio.ServicerContext
    ) -> discovery_pb2.DiscoveryResponse:
        version, secrets = self.store.snapshot()
        resp = discovery_pb2.DiscoveryResponse(version_info=str(version), type_url=type_urls.SECRET)
        for n in request.resource_names:
            if n in secrets:
                resp.resources.add().Pack(secrets[n])
        return resp


class SdsServer:
    """SDS on `unix:<path>` in its own thread and event loop."""

    def __init__(self, store: SecretStore, path: str) -> None:
        if len(path.encode()) > MAX_SOCKET_PATH:
            raise ValueError(
                f"SDS socket {path}: longer than {MAX_SOCKET_PATH} bytes (a unix "
                "socket limit); use a shorter identity dir"
            )
        self.store = store
        self.path = path
        self._runner: LoopThread | None = None
        self._server: grpc.aio.Server | None = None

    def start(self) -> SdsServer:
        async def boot() -> grpc.aio.Server:
            server = grpc.aio.server()
            sds_pb2_grpc.add_SecretDiscoveryServiceServicer_to_server(
                _Servicer(self.store, runner.loop), server
            )
            try:
                bound = server.add_insecure_port(f"unix:{self.path}")
            except RuntimeError:  # grpc.aio raises where grpc.server returns 0
                bound = 0
            if not bound:
                raise OSError(f"SDS socket {self.path}: cannot bind")
            await server.start()
            return server

        runner = LoopThread("sds")
        self._server = runner.start(boot)
        self._runner = runner
        return self

    def stop(self) -> None:
        if self._runner is None or self._server is None:
            return
        self._runner.stop(lambda: self._server.stop(0.2))
        self._server = None

"""Keep this sidecar's host registered with the control plane while its runtime serves.

One stream to the control plane's gRPC port (mesh_common/registry_wire.py) is the lease: it is
opened once the runtime first answers SERVING to grpc.health.v1 and the sidecar holds its
config, carries every later health change, and before the sidecar drains it deregisters and
waits until the callers' sidecars hold the removal (`deregister`), so no new call comes to a
closing listener. A stream that breaks (the control plane restarted, or moved to a replica) is
opened again with backoff and the host registered again; the control plane keeps a lost host for
its grace period, so a quick reconnect changes nothing for callers.

With identity the stream is mTLS with the agent's current certificate, checked against the
control plane's name in the mesh CA (the name the CA's own ports serve).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh_common import registry_wire as wire
from sidecar.identity import IdentityAgent

log = logging.getLogger("meshlm.sidecar")

_CHANNEL_OPTIONS = [
    # A control plane that vanished without closing the connection is noticed in seconds.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
_END = object()  # ends a stream's request iterator


class RuntimeHealth:
    """grpc.health.v1 Check of the runtime at `address` (loopback): True when SERVING.
    `watch(on_change)` also holds a grpc.health.v1 Watch stream and calls `on_change()` on each
    status it sends, so a waiting Registration checks at once instead of at its next poll."""

    def __init__(self, address: str, timeout: float = 1.0) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = health_pb2_grpc.HealthStub(self._channel)
        self._timeout = timeout
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None

    def __call__(self) -> bool:
        try:
            reply = self._stub.Check(health_pb2.HealthCheckRequest(), timeout=self._timeout)
        except (grpc.RpcError, ValueError):  # ValueError: after close()
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def watch(self, on_change: Callable[[], None], retry: float = 1.0) -> None:
        threading.Thread(
            target=self._watch, args=(on_change, retry), name="runtime-health", daemon=True
        ).start()

    def _watch(self, on_change: Callable[[], None], retry: float) -> None:
        while True:
            with self._lock:  # close() closes the channel under it: no call on a closed one
                if self._closed.is_set():
                    return
                call = self._call = self._stub.Watch(health_pb2.HealthCheckRequest())
            try:
                for _ in call:
                    on_change()
            except grpc.RpcError:
                pass  # the runtime is not up yet, or went away: polling still runs
            on_change()
            self._closed.wait(retry)

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            if self._call is not None:
                self._call.cancel()
        self._channel.close()


class Registration:
    """Registers `address` (where callers reach this host: the sidecar's inbound listener) for
    `service`/`version` with the first of `xds_addresses` that answers; `serving()` says whether
    the host serves (its runtime SERVING and its sidecar configured)."""

    def __init__(
        self,
        node_id: str,
        address: str,
        service: str,
        version: str,
        xds_addresses: list[tuple[str, int]],
        serving: Callable[[], bool],
        *,
        zone: str | None = None,
        weight: int | None = None,
        identity: IdentityAgent | None = None,
        poll_interval: float = 0.5,
        backoff: tuple[float, float] = (0.2, 5.0),
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.address = address
        self.service, self.version = service, version
        self.zone, self.weight = zone, weight
        self.xds_addresses = list(xds_addresses)
        self.serving = serving
        self.identity = identity
        self.poll_interval = poll_interval
        self.backoff = backoff
        self.on_event = on_event or (lambda msg: log.info("%s: %s", node_id, msg))
        self.registrations = 0  # streams on which the host was registered
        self._stop = threading.Event()
        self._wake = threading.Event()  # health may have changed: check before the next poll
        self._leaving = threading.Event()  # deregistering: no reconnect, no health messages
        self._left = threading.Event()  # the control plane answered the deregistration
        self._lock = threading.Lock()
        self._requests: queue.Queue | None = None  # the open stream's, once registered
        self._call: Any = None
        self._reported: bool | None = None  # the health the control plane has
        self._last_problem = ""
        self._thread: threading.Thread | None = None

    @property
    def registered(self) -> bool:
        return self._requests is not None

    def start(self) -> Registration:
        self._thread = threading.Thread(target=self._run, name="registration", daemon=True)
        self._thread.start()
        return self

    def deregister(self, timeout: float = 10.0) -> bool:
        """Leave the pool before draining: True once the control plane answered that the
        callers hold the removal (or gave up waiting on a slow one); False when there was no
        registration to end or no answer within `timeout`."""
        self._leaving.set()
        with self._lock:
            requests = self._requests
            if requests is not None:
                requests.put({"deregister": {}})
        left = requests is not None and self._left.wait(timeout)
        self.stop()
        return left

    def wake(self) -> None:
        """The runtime's health may have changed (its Watch stream said so): check now."""
        self._wake.set()

    def stop(self) -> None:
        self._leaving.set()
        self._stop.set()
        self._wake.set()
        self._close()
        if self._thread:
            self._thread.join(timeout=5)

    # -- the loop ---------------------------------------------------------------------------
    def _pause(self) -> bool:
        """Until the next poll or a wake(); True once stopped."""
        self._wake.wait(self.poll_interval)
        self._wake.clear()
        return self._stop.is_set()

    def _run(self) -> None:
        while not self._stop.is_set() and not self.serving():
            if self._pause():
                return
        delay = self.backoff[0]
        turn = 0
        while not self._stop.is_set() and not self._leaving.is_set():
            address = self.xds_addresses[turn % len(self.xds_addresses)]
            turn += 1
            if self._stream(address):
                delay = self.backoff[0]  # it was registered: the next try starts quickly
            if self._stop.wait(delay):
                return
            delay = min(delay * 2, self.backoff[1])

    def _stream(self, address: tuple[str, int]) -> bool:
        """One stream: register, follow health, until it ends; whether it registered."""
        target = f"{address[0]}:{address[1]}"
        requests: queue.Queue = queue.Queue()
        serving = self.serving()
        requests.put({"register": self._register_body(serving)})
        registered = False
        try:
            channel = self._channel(target)
        except RuntimeError as e:  # no certificate yet
            self._problem(str(e))
            return False
        with channel:
            call = channel.stream_stream(wire.REGISTER)(_messages(requests))
            with self._lock:
                self._call = call
            watcher = None
            try:
                for raw in call:
                    reply = json.loads(raw)
                    if "registered" in reply and not registered:
                        registered = True
                        self.registrations += 1
                        with self._lock:
                            self._requests = requests
                            self._reported = serving
                        self._last_problem = ""
                        self.on_event(
                            f"registered {self.address} for {self.service}/{self.version} "
                            f"with the control plane at {target}"
                        )
                        watcher = threading.Thread(
                            target=self._watch, args=(requests,), name="registration-health",
                            daemon=True,
                        )  # fmt: skip
                        watcher.start()
                    elif "deregistered" in reply:
                        acked = reply["deregistered"].get("acked")
                        held = "hold" if acked else "were slow to take"
                        self.on_event(
                            f"deregistered {self.address}: the callers {held} the removal"
                        )
                        self._left.set()
            except grpc.RpcError as e:
                if not self._leaving.is_set():
                    self._problem(f"registration with {target}: {e.code().name}: {e.details()}")
            except ValueError as e:
                self._problem(f"registration with {target}: not a JSON reply ({e})")
            finally:
                with self._lock:
                    self._requests = None
                    self._call = None
                requests.put(_END)
                if watcher is not None:
                    watcher.join(timeout=5)
        return registered

    def _watch(self, requests: queue.Queue) -> None:
        """Tell the control plane each change of health while the stream is registered."""
        while not self._pause():
            with self._lock:
                if self._requests is not requests or self._leaving.is_set():
                    return
                reported = self._reported
            now = self.serving()
            if now != reported:
                with self._lock:
                    if self._requests is not requests or self._leaving.is_set():
                        return
                    self._reported = now
                    requests.put({"health": wire.SERVING if now else wire.NOT_SERVING})
                self.on_event(
                    f"runtime {'SERVING' if now else 'NOT_SERVING'}: told the control plane"
                )

    def _register_body(self, serving: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "node_id": self.node_id,
            "address": self.address,
            "service": self.service,
            "version": self.version,
            "health": wire.SERVING if serving else wire.NOT_SERVING,
        }
        if self.zone is not None:
            body["zone"] = self.zone
        if self.weight is not None:
            body["weight"] = self.weight
        return body

    def _channel(self, target: str) -> grpc.Channel:
        if self.identity is None:
            return grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
        cur = self.identity.current
        if cur is None:
            raise RuntimeError("waiting for a certificate from the mesh CA before registering")
        creds = grpc.ssl_channel_credentials(
            root_certificates="".join(cur.bundle).encode(),
            private_key=cur.key_pem.encode(),
            certificate_chain="".join(cur.chain).encode(),
        )
        options = [*_CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", cur.ca["server_name"])]
        return grpc.secure_channel(target, creds, options=options)

    def _close(self) -> None:
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()

    def _problem(self, text: str) -> None:
        if text != self._last_problem:  # the same refusal on every retry is said once
            self._last_problem = text
            self.on_event(f"{text}; trying again")


def _messages(requests: queue.Queue) -> Iterator[bytes]:
    while True:
        item = requests.get()
        if item is _END:
            return
        yield json.dumps(item).encode()

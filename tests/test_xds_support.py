"""Helpers for the xDS tests: real gRPC upstreams that answer with their own name, a client that
calls through an Envoy listener, and a control plane with sidecars. No tests here."""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import struct_pb2
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from xds_server.mesh import Endpoint, Mesh, parse_mesh
from xds_server.server import XdsServer

METHOD = "/meshlm.inference.v1.Inference/Who"  # inside the API an `llm/*` rule allows


class _Who(grpc.GenericRpcHandler):
    def __init__(self, name: str) -> None:
        self.name = name.encode()
        self.calls = 0
        self.delay = 0.0  # seconds before each answer
        self.arrivals: list[float] = []  # time.monotonic() of each call

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        def who(request: bytes, context: grpc.ServicerContext) -> bytes:
            self.calls += 1
            self.arrivals.append(time.monotonic())
            if self.delay:
                time.sleep(self.delay)
            return self.name

        return grpc.unary_unary_rpc_method_handler(who)


class Upstream:
    """A real gRPC server on loopback that answers any unary call with its name."""

    def __init__(self, name: str, *, health: bool = False) -> None:
        self.name = name
        self.handler = _Who(name)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.health: HealthServicer | None = None
        if health:  # grpc.health.v1, what Envoy's grpc_health_check asks
            self.health = HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
            self.set_serving(True)
        self.server.add_generic_rpc_handlers((self.handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_serving(self, serving: bool) -> None:
        assert self.health is not None
        status = health_pb2.HealthCheckResponse
        self.health.set("", status.SERVING if serving else status.NOT_SERVING)

    def stop(self) -> None:
        self.server.stop(0)


@contextlib.contextmanager
def upstreams(*names: str, health: bool = False) -> Iterator[dict[str, Upstream]]:
    ups = {n: Upstream(n, health=health) for n in names}
    try:
        yield ups
    finally:
        for u in ups.values():
            u.stop()


class Caller:
    """A gRPC client that calls `service` through an Envoy listener (`:authority` = service)."""

    def __init__(self, port: int, service: str = "llm") -> None:
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.default_authority", service)]
        )
        self.call = self.channel.unary_unary(METHOD)

    def who(self, metadata: tuple[tuple[str, str], ...] = (), timeout: float = 10) -> str:
        return self.call(b"", metadata=metadata, timeout=timeout).decode()

    def close(self) -> None:
        self.channel.close()


class CallLoop:
    """Calls `who()` through an Envoy listener in a thread until the `with` block ends,
    counting answers by upstream name and keeping every failure."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.served: Counter[str] = Counter()
        self.failures: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        c = Caller(self.port)
        while not self._done.is_set():
            try:
                self.served[c.who(timeout=5)] += 1
            except Exception as e:  # any failed request fails the test
                self.failures.append(repr(e))
        c.close()

    def total(self) -> int:
        return sum(self.served.values())

    def __enter__(self) -> CallLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=10)


def llm_mesh(ups: dict[str, Upstream], weights: dict[str, int] | None = None, **extra: Any) -> Mesh:
    return parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {n: {"endpoints": [u.address]} for n, u in sorted(ups.items())},
                    "route": {"weights": weights or {"v1": 100}},
                    "retry_policy": {"retry_on": "unavailable,connect-failure", "num_retries": 2},
                    **extra,
                }
            }
        }
    )


def sidecar(
    cp: XdsServer, node_id: str, *, api_type: str = "GRPC", **kw: Any
) -> tuple[EnvoyProcess, int]:
    """An Envoy with an outbound listener, configured by `cp` alone; returns (envoy, port)."""
    port = free_port()
    b = ads_bootstrap(
        node_id,
        xds_address=("127.0.0.1", cp.grpc_port),
        outbound_port=port,
        api_type=api_type,
        **kw,
    )
    return EnvoyProcess(b), port


def eventually(check: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as e:  # a check that cannot run yet (envoy not up) counts as false
            last = e
        time.sleep(0.05)
    raise AssertionError(f"not true after {timeout}s: {what} (last: {last!r})")


def dynamic_clusters(envoy: EnvoyProcess) -> set[str]:
    dump = envoy.config_dump("dynamic_active_clusters")
    return {c["cluster"]["name"] for c in dump.get("configs", [])}


class AdsClient:
    """One ADS stream, driven by hand (no Envoy). `auto_ack`: the reader ACKs every response
    as soon as it arrives, as a healthy Envoy does. `status` holds how the server closed it."""

    def __init__(
        self,
        port: int,
        node_id: str,
        *,
        delta: bool = False,
        outbound: int = 15001,
        metadata: dict[str, Any] | None = None,
        auto_ack: bool = False,
        channel: grpc.Channel | None = None,
    ):
        self.node = base_pb2.Node(id=node_id)
        self.node.metadata.CopyFrom(struct_pb2.Struct())
        self.node.metadata.update(
            metadata if metadata is not None else {"meshlm.outbound_port": outbound}
        )
        self.channel = channel or grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel)
        self._tx: queue.Queue = queue.Queue()
        self._rx: queue.Queue = queue.Queue()
        self.delta, self.auto_ack = delta, auto_ack
        self._names: dict[str, list[str]] = {}  # SotW subscriptions, repeated in ACKs
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.closed = threading.Event()
        rpc = stub.DeltaAggregatedResources if delta else stub.StreamAggregatedResources
        self._call = rpc(iter(self._tx.get, None))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._first = True

    def _read(self) -> None:
        try:
            for r in self._call:
                if self.auto_ack:
                    self._ack(r)
                self._rx.put(r)
        except grpc.RpcError as e:
            self.status = (e.code(), e.details() or "")
        finally:
            self.closed.set()

    def _ack(self, r: Any) -> None:
        if self.delta:
            self.send(
                discovery_pb2.DeltaDiscoveryRequest(type_url=r.type_url, response_nonce=r.nonce)
            )
        else:
            self.send(sotw(r.type_url, self._names.get(r.type_url, ()), r.version_info, r.nonce))

    def send(self, req) -> None:
        if self._first:
            req.node.CopyFrom(self.node)
            self._first = False
        if not self.delta:
            self._names[req.type_url] = list(req.resource_names)
        self._tx.put(req)

    def recv(self, timeout: float = 10.0):
        return self._rx.get(timeout=timeout)

    def assert_quiet(self, seconds: float = 0.4) -> None:
        with pytest.raises(queue.Empty):
            r = self._rx.get(timeout=seconds)
            pytest.fail(f"unexpected response: {r.type_url} {r.nonce}")

    def closed_with(self, timeout: float = 10.0) -> tuple[grpc.StatusCode, str]:
        """How the server ended this stream (fails if it did not within `timeout`)."""
        assert self.closed.wait(timeout), "the server did not close the stream"
        assert self.status is not None, "the stream ended without a status"
        return self.status

    def close(self) -> None:
        self._tx.put(None)
        self._call.cancel()
        self.channel.close()


def sotw(type_url: str, names=(), version: str = "", nonce: str = "", error: str = ""):
    req = discovery_pb2.DiscoveryRequest(
        type_url=type_url, resource_names=list(names), version_info=version, response_nonce=nonce
    )
    if error:
        req.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
    return req


def with_unvalidated_endpoint(mesh: Mesh, version: str, host: str, port: int) -> Mesh:
    """`mesh` plus an endpoint built past the mesh validator (which refuses host names), so
    that Envoy itself rejects the change: the way to drive the NACK path."""
    svc = mesh.services["llm"]
    v = svc.versions[version]
    v = dataclasses.replace(v, endpoints=(*v.endpoints, Endpoint(host, port)))
    svc = dataclasses.replace(svc, versions={**svc.versions, version: v})
    return dataclasses.replace(mesh, services={**mesh.services, "llm": svc})

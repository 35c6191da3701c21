"""What a local process can hold on a runtime's ports: the gRPC port takes a bounded number of
connections and closes those that never speak HTTP/2; the metrics port serves a bounded number
of connections and closes idle ones. Real servers on loopback sockets."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from model_runtime.service import GRPC_HANDSHAKE_TIMEOUT_S, GRPC_MAX_CONNECTIONS, Runtime
from tests.test_xds_support import eventually

FLOOD = 40  # connections past the bound


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def idle_connections(port: int, n: int) -> Iterator[list[socket.socket]]:
    """`n` TCP connections to `port` that send nothing."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        yield socks
    finally:
        for s in socks:
            s.close()


def closed_by_server(socks: list[socket.socket]) -> int:
    """How many of `socks` the server has closed (EOF after whatever it sent)."""
    closed = 0
    for s in socks:
        s.settimeout(0.01)
        try:
            while s.recv(4096):
                pass
            closed += 1
        except TimeoutError:
            pass
        except OSError:  # reset
            closed += 1
    return closed


def health_check(target: str) -> int:
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        req = health_pb2.HealthCheckRequest()
        return health_pb2_grpc.HealthStub(ch).Check(req, timeout=5).status


def test_the_grpc_port_bounds_connections_and_closes_the_silent_ones() -> None:
    rt = Runtime().start()
    try:
        # The sidecar's connection, made before the flood, keeps serving through it.
        sidecar = grpc.insecure_channel(rt.target)
        stub = health_pb2_grpc.HealthStub(sidecar)
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        before = open_fds()
        with idle_connections(rt.port, GRPC_MAX_CONNECTIONS + FLOOD) as socks:
            # Past the bound, connections are closed as they arrive: the runtime's own
            # descriptors stay bounded (the client's sockets are in this process too).
            eventually(lambda: closed_by_server(socks) >= FLOOD, 10, "connections refused")
            assert open_fds() - before <= len(socks) + GRPC_MAX_CONNECTIONS
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            # Those that never speak HTTP/2 are closed after the handshake timeout, and a new
            # connection gets in again.
            eventually(
                lambda: closed_by_server(socks) == len(socks),
                GRPC_HANDSHAKE_TIMEOUT_S + 10,
                "silent connections closed",
            )
            assert health_check(rt.target)
        sidecar.close()
    finally:
        rt.shutdown(grace=1)

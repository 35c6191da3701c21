"""What a local process can hold on a runtime's ports: the gRPC port takes a bounded number of
connections and closes those that never speak HTTP/2; the metrics port serves a bounded number
of connections and closes idle ones; /score's forwards on the engine's thread are bounded in
size, in number waiting, and run one between two decode steps. Real servers on loopback
sockets, the real engine and model."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from model_runtime.engine.engine import MAX_TASKS, Engine, EngineFull, GenerateParams
from model_runtime.serving.records import SCORE_MAX_FORWARD_TOKENS, Records
from model_runtime.serving.service import GRPC_HANDSHAKE_TIMEOUT_S, GRPC_MAX_CONNECTIONS, Runtime
from model_runtime.serving.telemetry import (
    METRICS_IDLE_TIMEOUT_S,
    METRICS_MAX_CONNECTIONS,
    METRICS_READ_DEADLINE_S,
    MetricsServer,
    Telemetry,
)
from tests.test_xds_support import eventually

FLOOD = 40  # connections past the bound
STORY = [{"role": "user", "content": "Write a long story about a dragon and a knight."}]


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


def test_the_metrics_port_bounds_connections_and_closes_idle_ones() -> None:
    with MetricsServer(Telemetry()) as m:
        threads = threading.active_count()
        with idle_connections(m.port, METRICS_MAX_CONNECTIONS + FLOOD) as socks:
            # Past the bound, connections are answered 503 and closed: no thread each.
            eventually(lambda: closed_by_server(socks) >= FLOOD, 10, "connections refused")
            assert threading.active_count() - threads <= METRICS_MAX_CONNECTIONS
            # Idle ones are closed after the socket timeout, and the port serves again.
            eventually(
                lambda: closed_by_server(socks) == len(socks),
                METRICS_IDLE_TIMEOUT_S + 10,
                "idle connections closed",
            )
            url = f"http://127.0.0.1:{m.port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as r:
                assert r.status == 200


def test_the_metrics_port_cuts_a_request_that_trickles_in() -> None:
    """A byte every second keeps a socket timeout from firing; the request's deadline holds."""
    with MetricsServer(Telemetry()) as m, idle_connections(m.port, 1) as (sock,):
        started = time.monotonic()
        cut = False
        for byte in b"GET /metrics HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 120:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                cut = True
                break
            if closed_by_server([sock]):
                cut = True
                break
            if time.monotonic() - started > METRICS_READ_DEADLINE_S + 10:
                break
            time.sleep(1)
        assert cut and time.monotonic() - started < METRICS_READ_DEADLINE_S + 10


def test_the_metrics_port_never_reads_a_body_as_the_next_request() -> None:
    """A GET whose body is another request is refused and its connection closed, as on the
    OpenAI port: no bytes of one request become another."""
    smuggled = b"GET /metrics.json HTTP/1.1\r\nhost: x\r\n\r\n"
    head = f"GET /metrics HTTP/1.1\r\nhost: x\r\ncontent-length: {len(smuggled)}\r\n\r\n"
    with MetricsServer(Telemetry()) as m, idle_connections(m.port, 1) as (sock,):
        sock.sendall(head.encode() + smuggled)
        sock.settimeout(10)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 400"), answer[:80]
        assert answer.count(b"HTTP/1.1 ") == 1  # the smuggled GET got no answer


@contextlib.contextmanager
def decoding(engine: Engine, ids: list[int]) -> Iterator[None]:
    """Streams decode on `engine` throughout the block: each one that ends is replaced."""
    stop = threading.Event()

    def keep_busy(n: int) -> None:
        while not stop.is_set():
            done = threading.Event()
            params = GenerateParams(ids, max_new_tokens=32)
            engine.submit(f"busy-{n}", params, lambda ev, d=done: ev.finish_reason and d.set())
            done.wait(60)
            n += 2

    threads = [threading.Thread(target=keep_busy, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(60)


def test_engine_tasks_run_one_between_two_steps_and_their_queue_is_bounded(smollm_int4) -> None:
    """A /score is a forward on the engine's thread: queued ones never run back to back while
    streams decode, and no more than MAX_TASKS wait (the rest are refused at once)."""
    engine = Engine(smollm_int4, max_batch=2)
    engine.start()
    try:
        with decoding(engine, smollm_int4.tokenizer.encode_chat(STORY)):
            eventually(lambda: engine.tokens_generated > 0, 60, "decoding")
            # A task that holds the engine's thread: meanwhile, more arrive at once.
            held, release = threading.Event(), threading.Event()
            hold = threading.Thread(
                target=engine.run, args=(lambda: held.set() or release.wait(30),)
            )
            hold.start()
            assert held.wait(30)
            seen: list[int] = []
            refused: list[str] = []

            def task() -> None:
                try:
                    seen.append(engine.run(lambda: engine.tokens_generated, timeout=60))
                except EngineFull as e:
                    refused.append(str(e))

            waiting = [threading.Thread(target=task) for _ in range(MAX_TASKS + 3)]
            for t in waiting:
                t.start()
            eventually(lambda: len(refused) == 3, 10, "tasks past the bound refused")
            release.set()
            for t in [hold, *waiting]:
                t.join(60)
        # Each queued task ran after a decode step of its own: never two in one pause.
        assert len(seen) == MAX_TASKS and len(set(seen)) == MAX_TASKS, seen
        assert "tasks" in refused[0]
    finally:
        engine.shutdown()


def test_score_bounds_the_forward_it_runs(smollm_int4) -> None:
    records = Records()
    records.model = smollm_int4.model
    records.add("long", list(range(10, 10 + SCORE_MAX_FORWARD_TOKENS)), [5], "length")
    status, body = records.page("/score", "request_id=long&token_ids=5")
    assert status == 400, body
    assert f"{SCORE_MAX_FORWARD_TOKENS}" in json.loads(body)["error"]

"""The loop thread that runs the control plane's and a sidecar's grpc.aio servers
(mesh_common/loop_thread.py): a boot error reaches the caller and leaves no thread behind; stop
ends open streams (Envoy's SDS stream) instead of hanging on them, and lets a stopped server's
calls end by themselves rather than cancel them mid-cleanup (grpc then logs a traceback)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator

import grpc
import pytest
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from mesh_common.loop_thread import LoopThread
from mesh_common.sds_names import DEFAULT
from mesh_common.type_urls import SECRET as SECRET_TYPE
from sidecar.sds import SdsServer, SecretStore
from tests.test_identity_support import short_dir


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def _asks(ask: discovery_pb2.DiscoveryRequest, done: threading.Event) -> Iterator:
    """Like Envoy: one request, then the stream stays open."""
    yield ask
    done.wait(30)


def test_a_boot_error_is_raised_by_start_and_ends_the_thread(tmp_path) -> None:
    async def boot() -> None:
        raise OSError("port taken")

    runner = LoopThread("loop-thread-test-boot")
    with pytest.raises(OSError, match="port taken"):
        runner.start(boot)
    for t in _threads("loop-thread-test-boot"):
        t.join(timeout=5)
    assert runner.loop.is_closed() and not _threads("loop-thread-test-boot")
    with pytest.raises(OSError, match=r"SDS socket .*: cannot bind"):
        SdsServer(SecretStore(), str(tmp_path / "missing" / "sds.sock")).start()


def test_stop_ends_an_open_sds_stream() -> None:
    d, done = short_dir(), threading.Event()
    store = SecretStore()
    store.set(b"chain", b"key", b"bundle")
    sds = SdsServer(store, str(d / "sds.sock")).start()
    try:
        with grpc.insecure_channel(f"unix:{d / 'sds.sock'}") as ch:
            ask = discovery_pb2.DiscoveryRequest(type_url=SECRET_TYPE, resource_names=[DEFAULT])
            stream = sds_pb2_grpc.SecretDiscoveryServiceStub(ch).StreamSecrets(
                _asks(ask, done), timeout=30
            )
            assert next(stream).version_info == "1"  # the stream is open, waiting for more
            sds.stop()
            with pytest.raises(grpc.RpcError) as e:
                next(stream)
            assert e.value.code() != grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        done.set()
        sds.stop()
        (d / "sds.sock").unlink(missing_ok=True)
        d.rmdir()
    assert not _threads("sds") or all(not t.is_alive() for t in _threads("sds"))


def _slow_to_end_stream(ended: threading.Event) -> grpc.GenericRpcHandler:
    """A stream handler whose cleanup, once cancelled, takes a moment (as an ADS stream's does):
    its task is still running when the server has stopped."""

    async def chat(requests, context):
        try:
            yield b"hello"
            async for _ in requests:
                pass
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.2)
            ended.set()

    handler = grpc.stream_stream_rpc_method_handler(chat)
    return grpc.method_handlers_generic_handler("test.Slow", {"Chat": handler})


def test_stop_lets_a_stopped_servers_calls_end_without_a_traceback(caplog, capfd) -> None:
    caplog.set_level(logging.DEBUG)
    runner, done, ended = LoopThread("loop-thread-test-slow"), threading.Event(), threading.Event()
    server: grpc.aio.Server | None = None

    async def boot() -> int:
        nonlocal server
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_slow_to_end_stream(ended),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return port

    async def shutdown() -> None:
        await server.stop(0)
        await asyncio.sleep(0.05)  # other servers' shutdown: the cancelled call is ending now

    port = runner.start(boot)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stream = ch.stream_stream("/test.Slow/Chat")(_asks(b"hi", done), timeout=30)
            assert next(stream) == b"hello"
            runner.stop(shutdown)
    finally:
        done.set()
    out = caplog.text + "".join(capfd.readouterr())
    assert "Exception not handled" not in out and "Traceback" not in out, out
    assert ended.is_set(), "the handler's cleanup ran to its end"

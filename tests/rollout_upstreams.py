"""Tiny real gRPC upstreams and a traffic loop for the rollout tests (grpcio generic handlers)."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent import futures

import grpc

from mesh_common.ports import free_port

METHOD = "/meshlm.Llm/Generate"


class Upstream:
    """A gRPC server on loopback; `fail_percent` of calls end with UNAVAILABLE (HTTP 200 with
    grpc-status 14, the case 5xx counters miss). Failures are spread evenly, not random."""

    def __init__(self, name: str, fail_percent: float = 0.0) -> None:
        self.name = name
        self.fail_percent = fail_percent
        self.calls = 0
        self._lock = threading.Lock()
        self.port = free_port()
        handler = grpc.method_handlers_generic_handler(
            "meshlm.Llm", {"Generate": grpc.unary_unary_rpc_method_handler(self._generate)}
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")

    def _generate(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self._lock:
            self.calls += 1
            n = self.calls
        p = self.fail_percent
        if p and int(n * p / 100) != int((n - 1) * p / 100):
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: injected fault")
        return self.name.encode()

    def __enter__(self) -> Upstream:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0).wait(5)


class Traffic:
    """Calls METHOD through `target` in a loop on a thread; counts replies by upstream name
    (the reply body) and failures by gRPC status."""

    def __init__(self, target: str, pause_s: float = 0.005, authority: str | None = None) -> None:
        opts = [("grpc.default_authority", authority)] if authority else []
        self.channel = grpc.insecure_channel(target, options=opts)
        self.call = self.channel.unary_unary(METHOD)
        self.pause_s = pause_s
        self.replies: Counter[str] = Counter()
        self.codes: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.replies[self.call(b"x", timeout=5).decode()] += 1
                self.codes["OK"] += 1
            except grpc.RpcError as e:
                self.codes[e.code().name] += 1
            self._stop.wait(self.pause_s)

    def send(self, n: int) -> None:
        """n calls now, on the caller's thread."""
        for _ in range(n):
            try:
                self.replies[self.call(b"x", timeout=5).decode()] += 1
                self.codes["OK"] += 1
            except grpc.RpcError as e:
                self.codes[e.code().name] += 1

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.channel.close()

"""The demo's traffic generator is an open loop: every call goes out when its turn comes, however
slowly the mesh answers, and its latencies count from then (issue 13: with a pool of 16 workers a
slow mesh slowed the offered load and hid the wait; calls were sent up to seconds late)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc

from mesh_common.ports import free_port
from meshlm.demo.traffic import TenantLoad, Traffic
from model_runtime.serving.service import SERVICE
from schemas import codec

CALLS = 40  # more than the old pool of 16 workers


class HoldingUpstream:
    """A real gRPC Generate upstream that answers no call until CALLS calls arrived (or `cap`
    seconds passed): calls answered before that prove that callers waited for each other."""

    def __init__(self, cap: float = 20.0) -> None:
        self.arrived = 0
        self.all_in = threading.Event()
        self.cap = cap
        self._lock = threading.Lock()
        self.port = free_port()
        handler = grpc.method_handlers_generic_handler(
            SERVICE, {"Generate": grpc.unary_stream_rpc_method_handler(self._generate)}
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=CALLS + 8))
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")

    def _generate(self, request: bytes, context: grpc.ServicerContext):
        with self._lock:
            self.arrived += 1
            if self.arrived >= CALLS:
                self.all_in.set()
        self.all_in.wait(self.cap)
        yield codec.encode_token_chunk("r", 0, [1], "x", "length")

    def __enter__(self) -> HoldingUpstream:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0).wait(5)


def test_calls_go_out_on_schedule_while_the_upstream_holds_them() -> None:
    with HoldingUpstream() as up:
        load = TenantLoad("acme", "k", rate=CALLS / 0.5)  # all due within half a second
        traffic = Traffic(f"127.0.0.1:{up.port}", [load], resume=False, authority="llm").start()
        try:
            assert up.all_in.wait(15), f"only {up.arrived} of {CALLS} calls were sent"
        finally:
            time.sleep(0.5 / CALLS)  # let the pacer stop at its next turn
            traffic.stop()
    calls = sorted(traffic.outcomes, key=lambda o: o.at)[:CALLS]
    assert [o.status for o in calls] == ["OK"] * CALLS
    # Each call's TTFT counts from its turn: the first waited for the last one to be sent.
    assert calls[0].ttft_ms is not None and calls[0].ttft_ms >= (calls[-1].at - calls[0].at) * 1e3

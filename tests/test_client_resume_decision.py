"""The caller library's resume decision for a stream that breaks before its first token, on a
real gRPC server over loopback that answers Generate as a replica would: resumed once a replica
took it (its response headers came; a host cut off right after them is reset by the caller-side
Envoy's idle timeout, which retries no stream past its headers), the next attempt avoiding that
replica; a typed error when the call failed before any replica answered (the route's own retry
had its turn), and for an error of the request itself. The same path through Envoy and real
runtimes: tests/test_caller_resume.py and the multi-host demo's partition."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from mesh_common.headers import REPLICA_HEADER
from meshlm.client import Caller, Stall
from meshlm.client.errors import InternalError, InvalidArgument
from model_runtime.serving.client import GENERATE
from schemas import codec


class _Replicas(grpc.GenericRpcHandler):
    """Generate answered per attempt by `script`: ("reset-after-headers" | "reset" |
    "invalid" | "tokens"), each attempt as the next replica r1, r2..."""

    def __init__(self, *script: str) -> None:
        self.script = list(script)
        self.requests: list[codec.GenerateRequest] = []

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method != GENERATE:
            return None

        def generate(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            req = codec.decode_generate_request(request)
            self.requests.append(req)
            step = self.script[len(self.requests) - 1]
            if step != "reset":
                context.send_initial_metadata(((REPLICA_HEADER, f"r{len(self.requests)}"),))
            if step == "invalid":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad prompt")
            if step != "tokens":
                context.abort(grpc.StatusCode.INTERNAL, "Stream removed (RST_STREAM)")
            yield codec.encode_token_chunk(req.request_id or "", 0, [7, 8], "hi", "stop")

        return grpc.unary_stream_rpc_method_handler(generate)


def _serve(*script: str) -> tuple[grpc.Server, _Replicas, str]:
    handler = _Replicas(*script)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, handler, f"127.0.0.1:{port}"


def _generate(target: str):
    with Caller(target, stall=Stall(max_resumes=2)) as caller:
        stream = caller.generate("hi", max_new_tokens=2, timeout=30, mirror=False)
        ids = [int(t) for chunk in stream for t in chunk.token_ids]
        return ids, stream, caller.resumes


def test_a_stream_reset_after_a_replicas_headers_is_resumed_with_nothing_delivered() -> None:
    server, handler, target = _serve("reset-after-headers", "tokens")
    try:
        ids, stream, resumes = _generate(target)
    finally:
        server.stop(0)
    assert ids == [7, 8]
    assert [(r.replica, r.delivered) for r in stream.resumes] == [("r1", 0)] and resumes == 1
    assert handler.requests[1].avoid_replica == "r1"
    assert list(handler.requests[1].resume_token_ids) == []


@pytest.mark.parametrize(
    ("step", "error"),
    [("reset", InternalError), ("invalid", InvalidArgument)],
    ids=["before-any-replica-answered", "the-requests-own-error"],
)
def test_a_failure_no_resume_can_fix_is_a_typed_error(step: str, error: type) -> None:
    server, handler, target = _serve(step, "tokens")
    try:
        with pytest.raises(error):
            _generate(target)
    finally:
        server.stop(0)
    assert len(handler.requests) == 1

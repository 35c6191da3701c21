"""meshlm's clients mark a greedy call safe to mirror (issue 18): `x-meshlm-mirror: safe` on the
sync and async Caller's generate/complete/chat and on the low-level Client, unless the call is
sampled, a resume, or the caller says mirror=False; the caller's own header value wins.

Observed on the wire by a stand-in runtime (a real gRPC server on loopback) that records each
call's headers and answers with real TokenChunks; a call whose request_id is "fail-once" sends
one token, then fails UNAVAILABLE, so the Caller resumes it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from meshlm.client import AsyncCaller, Caller
from model_runtime.serving.client import GENERATE, Client
from schemas import codec

CHAT = [{"role": "user", "content": "Hi"}]


class Recorder:
    """Generate calls' x-meshlm-mirror values (a list per call: repeated headers show)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.unary_stream_rpc_method_handler(self._generate)
        service, method = GENERATE.rsplit("/", 1)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service.lstrip("/"), {method: handler}),)
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _generate(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        self.calls.append([v for k, v in context.invocation_metadata() if k == "x-meshlm-mirror"])
        req = codec.decode_generate_request(request)
        if req.request_id == "fail-once" and req.resume_token_ids is None:
            yield codec.encode_token_chunk(req.request_id, 0, [7], "a", None, 0, 1, None)
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica lost")
        index = req.resume_index
        yield codec.encode_token_chunk(req.request_id, index, [8], "b", "length", 0, 1, None)

    def take(self) -> list[list[str]]:
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture(scope="module")
def recorder() -> Iterator[Recorder]:
    r = Recorder()
    try:
        yield r
    finally:
        r.server.stop(0)


SAFE, UNMARKED = ["safe"], []


def test_the_caller_marks_greedy_calls_only(recorder: Recorder) -> None:
    with Caller(f"127.0.0.1:{recorder.port}") as llm:
        llm.chat(CHAT)
        llm.complete("Hi", temperature=0.0)
        list(llm.generate(prompt="Hi"))
        assert recorder.take() == [SAFE, SAFE, SAFE]
        llm.chat(CHAT, temperature=0.7)
        llm.chat(CHAT, mirror=False)
        list(llm.generate(prompt="Hi", mirror=False))
        assert recorder.take() == [UNMARKED, UNMARKED, UNMARKED]
        llm.chat(CHAT, metadata=[("x-meshlm-mirror", "no")])  # the caller's own value wins
        assert recorder.take() == [["no"]]


def test_a_resumed_attempt_is_never_marked(recorder: Recorder) -> None:
    with Caller(f"127.0.0.1:{recorder.port}") as llm:
        reply = llm.chat(CHAT, request_id="fail-once")
    assert reply.token_ids == [7, 8] and len(reply.resumes) == 1
    assert recorder.take() == [SAFE, UNMARKED]  # the resume carries resume_token_ids


def test_a_callers_metadata_header_is_not_doubled(recorder: Recorder) -> None:
    target = f"127.0.0.1:{recorder.port}"
    with Caller(target, metadata=[("x-meshlm-mirror", "no")]) as llm:
        llm.chat(CHAT)
    assert recorder.take() == [["no"]]


def test_the_async_caller_marks_as_the_sync_one(recorder: Recorder) -> None:
    async def calls() -> None:
        async with AsyncCaller(f"127.0.0.1:{recorder.port}") as llm:
            await llm.chat(CHAT)
            await llm.chat(CHAT, temperature=0.5)
            await llm.complete("Hi", mirror=False)
            await llm.chat(CHAT, request_id="fail-once")

    asyncio.run(calls())
    assert recorder.take() == [SAFE, UNMARKED, UNMARKED, SAFE, UNMARKED]


def test_the_low_level_client_marks_greedy_calls(recorder: Recorder) -> None:
    with Client(f"127.0.0.1:{recorder.port}") as c:
        list(c.generate("Hi"))
        list(c.generate("Hi", temperature=0.9))
        list(c.generate("Hi", mirror=False))
    assert recorder.take() == [SAFE, UNMARKED, UNMARKED]

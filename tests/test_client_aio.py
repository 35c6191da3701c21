"""meshlm.client.AsyncCaller (grpc.aio), the same API as Caller awaited (issue 17, item 3):
through a real Envoy with the Wasm authz filter to a real runtime, and straight to a runtime
that stalls after 5 tokens (the resume logic: detected, resumed, refused, given up)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from meshlm.client import (
    AsyncCaller,
    Caller,
    DeadlineExceeded,
    RateLimited,
    Stall,
    StreamLost,
    Unauthenticated,
)
from model_runtime.serving.faults import Faults
from tests.client_support import CHAT, Guarded, guarded_runtime
from tests.runtime_fixtures import serving_runtime


@pytest.fixture(scope="module")
def guarded(smollm_int4) -> Iterator[Guarded]:
    yield from guarded_runtime(smollm_int4)


@pytest.fixture(scope="module")
def staller(smollm_int4):
    rt = serving_runtime(smollm_int4, faults=Faults(stall_after=5), replica_id="staller")
    try:
        yield rt
    finally:
        rt.shutdown(grace=1)


def test_async_chat_and_stream_equal_the_sync_client(guarded: Guarded) -> None:
    with Caller(guarded.target, api_key="k-acme", authority="llm") as sync:
        expected = sync.chat(CHAT, max_new_tokens=6, timeout=60)

    async def run() -> tuple:
        async with AsyncCaller(guarded.target, api_key="k-acme", authority="llm") as llm:
            reply = await llm.chat(CHAT, max_new_tokens=6, timeout=60)
            stream = llm.generate(messages=CHAT, max_new_tokens=6, timeout=60)
            chunks = [c async for c in stream]
            return reply, chunks, stream.replicas, (await llm.info()).context_length

    reply, chunks, replicas, context = asyncio.run(run())
    assert (reply.text, reply.token_ids, reply.finish_reason) == (
        expected.text,
        expected.token_ids,
        "length",
    )
    assert "".join(c.text_delta for c in chunks) == expected.text
    assert replicas == ["r1"] and context > 0


def test_async_refusals_are_typed_errors(guarded: Guarded) -> None:
    async def run() -> None:
        async with AsyncCaller(guarded.target, authority="llm") as anonymous:
            with pytest.raises(Unauthenticated):
                await anonymous.chat(CHAT, max_new_tokens=1, timeout=30)
        async with AsyncCaller(guarded.target, api_key="k-lim", authority="llm") as limited:
            for _ in range(2):
                await limited.chat(CHAT, max_new_tokens=1, timeout=60)
            with pytest.raises(RateLimited) as e:
                await limited.chat(CHAT, max_new_tokens=1, timeout=60)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    asyncio.run(run())


def test_async_stream_resumes_a_stall_then_gives_up_as_the_sync_one(staller) -> None:
    """Straight to the stalling runtime: the stall is detected after 5 tokens, the resume goes
    back to it, which refuses it (it is the replica to avoid); max_resumes 1 ends the stream."""
    stall = Stall(gap=0.2, hard_limit=0.6, max_resumes=1)

    async def run():
        async with AsyncCaller(staller.target, stall=stall) as llm:
            stream = llm.generate(messages=CHAT, max_new_tokens=14, timeout=30)
            with pytest.raises(StreamLost) as e:
                await stream.result()
            return e.value, stream, llm.resumes

    err, stream, resumes = asyncio.run(run())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "gave up after 1 resumes (max_resumes 1), 5 tokens delivered" in err.details()
    assert (stream.resumes[0].replica, stream.resumes[0].delivered, resumes) == ("staller", 5, 1)
    assert len(stream.token_ids) == 5


def test_async_stream_past_its_deadline_is_not_resumed(staller) -> None:
    async def run():
        async with AsyncCaller(staller.target, stall=Stall(gap=0.2, hard_limit=5.0)) as llm:
            stream = llm.generate(messages=CHAT, max_new_tokens=14, timeout=2.0)
            with pytest.raises(DeadlineExceeded):
                async for _ in stream:
                    pass
            return stream

    stream = asyncio.run(run())
    assert (stream.resumes, len(stream.token_ids)) == ([], 5)

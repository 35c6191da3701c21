"""meshlm.client.Caller, the documented Python client (issue 17, item 3), through a real Envoy
with the Wasm authz filter to a real runtime: the whole answer (chat, complete) equals the
stream, and each refusal arrives as its typed error, still a grpc.RpcError."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from mesh_common.ports import free_port
from meshlm.client import (
    Caller,
    InvalidArgument,
    MeshlmError,
    PermissionDenied,
    RateLimited,
    Unauthenticated,
    Unavailable,
)
from tests.client_support import CHAT, Guarded, guarded_runtime


@pytest.fixture(scope="module")
def guarded(smollm_int4) -> Iterator[Guarded]:
    yield from guarded_runtime(smollm_int4)


def test_chat_is_the_stream_collected(guarded: Guarded) -> None:
    with Caller(guarded.target, api_key="k-acme", authority="llm") as llm:
        reply = llm.chat(CHAT, max_new_tokens=6, timeout=60)
        assert (len(reply.token_ids), reply.finish_reason) == (6, "length")
        assert reply.replicas == ["r1"] and reply.resumes == [] and reply.ttft_us is not None
        chunks = list(llm.generate(messages=CHAT, max_new_tokens=6, timeout=60))
        assert "".join(c.text_delta for c in chunks) == reply.text and reply.text.strip()
        assert [int(t) for c in chunks for t in c.token_ids] == reply.token_ids
        raw = llm.complete("The capital of France is", max_new_tokens=3, timeout=60)
        assert len(raw.token_ids) == 3 and raw.text
        assert llm.info().context_length > 0


def test_refusals_are_typed_errors(guarded: Guarded) -> None:
    with Caller(guarded.target, authority="llm") as anon, pytest.raises(Unauthenticated) as e:
        anon.chat(CHAT, max_new_tokens=1, timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert isinstance(e.value, grpc.RpcError) and isinstance(e.value, MeshlmError)
    with Caller(guarded.target, api_key="k-free", authority="llm") as free:
        with pytest.raises(PermissionDenied):
            free.info(timeout=30)  # "free" may call llm/Generate only
        assert free.chat(CHAT, max_new_tokens=1, timeout=60).token_ids
    with Caller(guarded.target, api_key="k-lim", authority="llm") as limited:
        for _ in range(2):
            limited.chat(CHAT, max_new_tokens=1, timeout=60)
        with pytest.raises(RateLimited) as e:
            limited.chat(CHAT, max_new_tokens=1, timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_shadow_copy_is_authorized_but_not_charged(guarded: Guarded) -> None:
    """Through real Envoy and the Wasm filter: `:authority` suffixed -shadow (as Envoy's request
    mirroring sends the copy) passes authz without taking the tenant's token; the tenant's own
    calls still spend it, and an unknown key is refused on a copy too (issue 18)."""
    with Caller(guarded.target, api_key="k-mirrored", authority="llm-shadow") as copy:
        for _ in range(3):
            assert copy.chat(CHAT, max_new_tokens=1, timeout=60).token_ids
    bad = Caller(guarded.target, api_key="nope", authority="llm-shadow")
    with bad, pytest.raises(Unauthenticated):
        bad.chat(CHAT, max_new_tokens=1, timeout=30)
    with Caller(guarded.target, api_key="k-mirrored", authority="llm") as own:
        assert own.chat(CHAT, max_new_tokens=1, timeout=60).token_ids
        with pytest.raises(RateLimited):
            own.chat(CHAT, max_new_tokens=1, timeout=60)


def test_bad_input_and_no_server_are_typed_errors(guarded: Guarded) -> None:
    with Caller(guarded.target, api_key="k-acme", authority="llm") as llm:
        with pytest.raises(InvalidArgument, match="seed") as e:
            llm.generate(messages=CHAT, seed=-5)  # found before anything is sent
        assert isinstance(e.value, ValueError)
        with pytest.raises(InvalidArgument, match="unexpected keyword"):
            llm.chat(CHAT, max_tokens=5)
        with pytest.raises(InvalidArgument, match="prompt") as e:  # the runtime's own check
            llm.complete("word " * 20000, max_new_tokens=1, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with Caller(f"127.0.0.1:{free_port()}") as nobody, pytest.raises(Unavailable):
        nobody.chat(CHAT, max_new_tokens=1, timeout=10)

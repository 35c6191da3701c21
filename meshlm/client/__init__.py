"""The Python client of a meshlm mesh: call the model through your caller-side sidecar (or a
runtime directly) over gRPC, with streams that survive a replica that stalls or dies.

    from meshlm.client import Caller, RateLimited

    with Caller("127.0.0.1:15001", api_key=os.environ["MESHLM_API_KEY"], authority="llm") as llm:
        # Stream: TokenChunk objects as the model produces them.
        for chunk in llm.generate(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=64):
            print(chunk.text_delta, end="", flush=True)
        # The whole answer at once: a Completion (text, token_ids, finish_reason, ttft_us...).
        reply = llm.chat([{"role": "user", "content": "Name three rivers."}], temperature=0.7)
        text = llm.complete("Once upon a time", max_new_tokens=32).text

asyncio, the same API awaited (create it inside the running event loop):

    from meshlm.client import AsyncCaller

    async with AsyncCaller("127.0.0.1:15001", api_key=key, authority="llm") as llm:
        async for chunk in llm.generate(messages=chat):
            ...
        reply = await llm.chat(chat)

Target and authority: through the mesh, `target` is your caller sidecar's outbound listener
and `authority` the service (`llm`); a runtime can be called directly with neither. The API key
travels as `x-api-key`; headers for routing go in `metadata`, e.g. [("x-canary", "always")].

Parameters of generate/complete/chat: max_new_tokens, temperature (0: greedy), top_p, top_k,
seed, stop (a list of strings), priority, request_id, model; `timeout` in seconds bounds the
whole call, resumes included; `mirror` (default True): a greedy call (temperature 0) is sent
with `x-meshlm-mirror: safe`, so that during a canary rollout with a quality gate the mesh may
send a copy to the canary, to compare its answer with yours (you get only your own answer, not
delayed). Pass mirror=False for a call that must not run twice. Sampled calls and resumed
attempts are never marked; calls through the OpenAI HTTP API are never mirrored.

Errors are grpc.RpcError subclasses, one per status a caller handles differently (see
meshlm.client.errors): Unauthenticated (no or unknown key), PermissionDenied (the tenant may not
call it), RateLimited (the tenant's limit or a full queue: retry later), Unavailable (no replica;
StreamLost when a stream's resumes ran out), InvalidArgument (names the field; also a
ValueError), DeadlineExceeded, NoRoute (the authority is not a service of the mesh),
InternalError; MeshlmError is their base.
"""

from __future__ import annotations

from meshlm.client.aio import AsyncCaller, AsyncStream
from meshlm.client.caller import Caller, Stall, Stream
from meshlm.client.core import Completion, Resume
from meshlm.client.errors import (
    Cancelled,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    MeshlmError,
    NoRoute,
    PermissionDenied,
    RateLimited,
    StreamLost,
    Unauthenticated,
    Unavailable,
)
from schemas.codec import ChatMessage, ModelInfo, TokenChunk

__all__ = [
    "AsyncCaller",
    "AsyncStream",
    "Caller",
    "Cancelled",
    "ChatMessage",
    "Completion",
    "DeadlineExceeded",
    "InternalError",
    "InvalidArgument",
    "MeshlmError",
    "ModelInfo",
    "NoRoute",
    "PermissionDenied",
    "RateLimited",
    "Resume",
    "Stall",
    "Stream",
    "StreamLost",
    "TokenChunk",
    "Unauthenticated",
    "Unavailable",
]

"""A small client for the runtime (directly, or through a sidecar: pass `authority` = the mesh
service name and `api_key`).

    for chunk in generate("127.0.0.1:50051", "What is the capital of France?", max_new_tokens=8):
        print(chunk.text_delta, end="")

Closing the iterator early (break, `.close()`) cancels the call, which frees the request's KV
blocks on the runtime. A greedy call (temperature 0) is marked safe to mirror
(`x-meshlm-mirror: safe`): during a canary rollout with a quality gate the caller's sidecar may
send a copy to the canary, whose answer is only compared, never returned; pass
`mirror=False` for a call that must not run twice. Callers of the mesh want
`meshlm.client.Caller` instead: the same calls, plus resuming a stream on another replica when
its replica stalls or dies.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from mesh_common.headers import API_KEY_HEADER, MIRROR_HEADER, MIRROR_SAFE
from schemas import codec
from schemas.codec import ChatMessage, GenerateRequest, ModelInfo, TokenChunk

GENERATE = "/meshlm.inference.v1.Inference/Generate"
INFO = "/meshlm.inference.v1.Inference/Info"

Metadata = Sequence[tuple[str, str]]


def mirror_safe(req: GenerateRequest, mirror: bool, *metadata: Metadata) -> bool:
    """Whether a call gets `x-meshlm-mirror: safe`: the caller allows it (`mirror`), it is
    greedy (temperature 0, not a resume: only such answers compare) and no metadata of the
    call sets the header already (the caller's own value wins)."""
    if not mirror or req.temperature > 0 or req.resume_token_ids is not None:
        return False
    return not any(k.lower() == MIRROR_HEADER for md in metadata for k, _ in md)


def generate_request(
    prompt: str | None,
    messages: Sequence[ChatMessage | dict[str, str]] | None,
    prompt_token_ids: Sequence[int] | None,
    params: dict[str, Any],
) -> GenerateRequest:
    """A GenerateRequest validated as the server will (codec.WireError, a ValueError naming the
    field; TypeError for an unknown parameter or message field), before anything is sent."""
    msgs = None
    if messages is not None:
        msgs = [m if isinstance(m, ChatMessage) else ChatMessage(**m) for m in messages]
    req = GenerateRequest(
        prompt=prompt,
        messages=msgs,
        prompt_token_ids=None if prompt_token_ids is None else list(prompt_token_ids),
        **params,
    )
    codec.validate_generate_request(req)
    return req


class Client:
    """One channel to a runtime or sidecar; reuse it for many calls."""

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        authority: str | None = None,
        metadata: Metadata = (),
    ) -> None:
        options = [("grpc.default_authority", authority)] if authority else []
        self.channel = grpc.insecure_channel(target, options=options)
        self.metadata = list(metadata) + ([(API_KEY_HEADER, api_key)] if api_key else [])
        self._generate = self.channel.unary_stream(GENERATE)
        self._info = self.channel.unary_unary(INFO)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate_raw(
        self, request: bytes, *, timeout: float | None = None, metadata: Metadata = ()
    ) -> Any:
        """The bare call: an iterator of TokenChunk buffers that is also a grpc.Call."""
        return self._generate(request, timeout=timeout, metadata=self.metadata + list(metadata))

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[ChatMessage | dict[str, str]] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        metadata: Metadata = (),
        mirror: bool = True,
        **params: Any,
    ) -> Iterator[TokenChunk]:
        """Stream decoded chunks. `params`: GenerateRequest fields (max_new_tokens, temperature,
        top_p, top_k, seed, stop, priority, request_id, model). A greedy call is sent with
        `x-meshlm-mirror: safe` unless `mirror=False` (module doc). Raises grpc.RpcError on a
        non-OK status, after yielding whatever arrived before it."""
        req = generate_request(prompt, messages, prompt_token_ids, params)
        md = list(metadata)
        if mirror_safe(req, mirror, self.metadata, md):
            md.append((MIRROR_HEADER, MIRROR_SAFE))
        call = self.generate_raw(codec.encode_generate_request(req), timeout=timeout, metadata=md)
        try:
            for buf in call:
                yield codec.decode_token_chunk(buf)
        finally:
            call.cancel()  # no-op once the stream ended; frees the server side if we stop early

    def info(self, *, timeout: float | None = 10.0, metadata: Metadata = ()) -> ModelInfo:
        """The served model's name, precision, version and context length, and what it computes
        in there (compute_dtype, compute, kernels: "" from a server older than those fields)."""
        buf = self._info(
            codec.encode_info_request(), timeout=timeout, metadata=self.metadata + list(metadata)
        )
        return codec.decode_model_info(buf)


def generate(
    target: str,
    prompt: str | None = None,
    *,
    api_key: str | None = None,
    authority: str | None = None,
    metadata: Metadata = (),
    timeout: float | None = None,
    mirror: bool = True,
    **params: Any,
) -> Iterator[TokenChunk]:
    """One-shot streaming call on a fresh channel (closed when the iterator ends); `mirror`
    as Client.generate's."""
    with Client(target, api_key=api_key, authority=authority, metadata=metadata) as c:
        yield from c.generate(prompt, timeout=timeout, mirror=mirror, **params)


def info(
    target: str,
    *,
    api_key: str | None = None,
    authority: str | None = None,
    metadata: Metadata = (),
    timeout: float | None = 10.0,
) -> ModelInfo:
    with Client(target, api_key=api_key, authority=authority, metadata=metadata) as c:
        return c.info(timeout=timeout)

"""AsyncCaller: the Python client (meshlm.client.Caller) on asyncio (grpc.aio), the same API
awaited: generate() gives an async iterator that resumes a stalled or broken stream the same
way, complete(), chat() and info() are coroutines, errors are the same meshlm.client.errors
classes. What it shares with Caller (requests, resume decisions, errors) is meshlm/client/core.py.

    async with AsyncCaller("127.0.0.1:15001", api_key=KEY, authority="llm") as llm:
        async for chunk in llm.generate(messages=[{"role": "user", "content": "Hi"}]):
            print(chunk.text_delta, end="")
        reply = await llm.chat([{"role": "user", "content": "And in French?"}])
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio

from mesh_common.headers import API_KEY_HEADER
from meshlm.client.core import SILENT, CallerBase, Completion, Ended, Progress, string_headers
from meshlm.client.errors import from_rpc_error
from model_runtime.serving.client import GENERATE, INFO, Metadata
from schemas import codec
from schemas.codec import ChatMessage, ModelInfo, TokenChunk
from xds_server.mesh import Stall

__all__ = ["AsyncCaller", "AsyncStream"]


class AsyncCaller(CallerBase):
    """One grpc.aio channel to a caller-side sidecar (or a runtime), for one event loop; the
    arguments are Caller's."""

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        authority: str | None = None,
        metadata: Metadata = (),
        stall: Stall | None = None,
    ) -> None:
        super().__init__(stall, list(metadata) + ([(API_KEY_HEADER, api_key)] if api_key else []))
        options = [("grpc.default_authority", authority)] if authority else []
        self.channel = grpc.aio.insecure_channel(target, options=options)
        self._generate = self.channel.unary_stream(GENERATE)
        self._info = self.channel.unary_unary(INFO)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncCaller:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def info(self, *, timeout: float | None = 10.0, metadata: Metadata = ()) -> ModelInfo:
        """The served model's name, precision, version and context length, and what it computes
        in there (compute_dtype, compute, kernels: "" from a server older than those fields)."""
        try:
            buf = await self._info(
                codec.encode_info_request(),
                timeout=timeout,
                metadata=self.metadata + list(metadata),
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        return codec.decode_model_info(buf)

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
    ) -> AsyncStream:
        """Caller.generate as an async iterator (`async for chunk in ...`); a greedy call is
        marked `x-meshlm-mirror: safe` unless `mirror=False` (meshlm.client.caller's doc)."""
        progress = self.progress(
            prompt,
            messages,
            prompt_token_ids,
            params,
            timeout=timeout,
            metadata=metadata,
            mirror=mirror,
        )
        return AsyncStream(self, progress)

    async def complete(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[ChatMessage | dict[str, str]] | None = None,
        timeout: float | None = None,
        metadata: Metadata = (),
        mirror: bool = True,
        **params: Any,
    ) -> Completion:
        """The whole answer at once: await generate(...).result()."""
        stream = self.generate(
            prompt, messages=messages, timeout=timeout, metadata=metadata, mirror=mirror, **params
        )
        return await stream.result()

    async def chat(
        self,
        messages: Sequence[ChatMessage | dict[str, str]],
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        mirror: bool = True,
        **params: Any,
    ) -> Completion:
        """The assistant's whole reply to `messages`."""
        return await self.complete(
            messages=messages, timeout=timeout, metadata=metadata, mirror=mirror, **params
        )


class AsyncStream:
    """An async iterator of TokenChunk with Stream's `token_ids`, `resumes` and `replicas`."""

    def __init__(self, caller: AsyncCaller, progress: Progress) -> None:
        self.caller, self.request, self.progress = caller, progress.request, progress
        self.token_ids = progress.token_ids
        self.resumes = progress.resumes
        self.replicas = progress.replicas
        self._gen = self._run()

    def __aiter__(self) -> AsyncIterator[TokenChunk]:
        return self

    async def __anext__(self) -> TokenChunk:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        """Cancel the stream (never resumed after this)."""
        await self._gen.aclose()

    async def result(self) -> Completion:
        """Read the rest of the stream; the whole answer."""
        async for _ in self:
            pass
        return self.progress.completion()

    async def _run(self) -> AsyncIterator[TokenChunk]:
        p = self.progress
        while True:
            request, timeout, md = p.attempt()
            md = self.caller.metadata + md
            call = self.caller._generate(request, timeout=timeout, metadata=md)
            attempt = _AsyncAttempt(call)
            try:
                while True:
                    try:
                        event = await asyncio.wait_for(attempt.events.get(), p.wait())
                    except TimeoutError:
                        event = SILENT
                    out = p.event(*event)
                    if isinstance(out, Ended):
                        break
                    if out is not None:
                        yield out
            finally:
                await attempt.stop()  # a no-op once the stream ended; on close: the cancel
            if out.failure is None:
                return
            p.failed(out.failure, attempt.headers)


class _AsyncAttempt:
    """One call read by a task, so that the stream's gaps can be timed (as caller._Attempt)."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.headers: dict[str, str] = {}
        self.events: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        put = self.events.put_nowait
        try:
            self.headers = string_headers(await self.call.initial_metadata())
            put(("headers", self.headers, time.monotonic()))
            async for buf in self.call:
                put(("chunk", buf, time.monotonic()))
            put(("end", None, time.monotonic()))
        except grpc.RpcError as e:
            put(("error", e, time.monotonic()))

    async def stop(self) -> None:
        self.call.cancel()
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

"""The Python client of the mesh: generate (streaming), complete, chat, model info, with typed
errors (meshlm.client.errors); a stream survives a replica that stalls or dies. `meshlm.client`
is the documented entry point (it also has AsyncCaller, the same API on asyncio).

    from meshlm.client import Caller

    with Caller("127.0.0.1:15001", api_key=KEY, authority="llm") as llm:
        for chunk in llm.generate(messages=[{"role": "user", "content": "Hi"}]):
            print(chunk.text_delta, end="")

Envoy retries a call only before its response headers; after them only the caller holds the
tokens already delivered. So a stream that stalls (`consecutive` inter-token gaps over
`gap` in a row, or one gap over `hard_limit`) or ends with a transport error after tokens is
cancelled and resumed: the same request plus the delivered token ids, sent again with
`avoid_replica` (the failed replica's `x-meshlm-replica`) and pinned to the version that served
it (`x-meshlm-version`, added by the caller-side route). The runtime continues the generation
without re-emitting a token, so the caller sees one whole stream; only `Caller.resumes`, the
stream's `resumes` and a log line / trace event `meshlm.stream.resumed` tell. After `max_resumes`
resumes the stream ends with `StreamLost` (Unavailable). A stream the caller closed, or whose
deadline passed, is never resumed.

The thresholds come from the mesh file's `services.<name>.stall` block, which the caller-side
route sends as the `x-meshlm-stall` response header; `stall=Stall(...)` overrides it. Without a
mesh (a runtime called directly) the defaults apply.

A greedy call (temperature 0) is marked safe to mirror (`x-meshlm-mirror: safe`): during a
canary rollout with a quality gate the caller-side route may send a copy to the canary, whose
answer the runtimes record for comparison and Envoy drops; the caller sees only its own answer
and is not delayed. `mirror=False` leaves a call unmarked (a call that must not run
twice); sampled calls and resumed attempts are never marked. The OpenAI HTTP API's calls are
never marked (the mesh mirrors gRPC calls only).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from meshlm.client.core import (
    SILENT,
    CallerBase,
    Completion,
    Ended,
    Progress,
    Resume,
    string_headers,
)
from meshlm.client.errors import StreamLost, from_rpc_error
from model_runtime.serving.client import Client, Metadata
from schemas.codec import ChatMessage, ModelInfo, TokenChunk
from xds_server.mesh import Stall

__all__ = ["Caller", "Completion", "Resume", "Stall", "Stream", "StreamLost"]


class Caller(CallerBase):
    """One channel to a caller-side sidecar (or a runtime); thread-safe, reuse it.

    `target`: HOST:PORT. `api_key`: sent as x-api-key, which the sidecar's authz checks.
    `authority`: the mesh service to call (through a sidecar). `metadata`: headers sent with
    every call, e.g. [("x-canary", "always")]. `stall`: thresholds that override the mesh's."""

    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        authority: str | None = None,
        metadata: Metadata = (),
        stall: Stall | None = None,
    ) -> None:
        self.client = Client(target, api_key=api_key, authority=authority, metadata=metadata)
        super().__init__(stall, self.client.metadata)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Caller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def info(self, *, timeout: float | None = 10.0, metadata: Metadata = ()) -> ModelInfo:
        """The served model: name, precision, version, context length, and what it computes in
        on its CPU (compute_dtype, compute, kernels)."""
        try:
            return self.client.info(timeout=timeout, metadata=metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

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
    ) -> Stream:
        """Stream decoded chunks (TokenChunk: text_delta, token_ids, finish_reason...), resuming
        on another replica when one stalls or fails. Give one of `prompt` (plain text),
        `messages` (chat: [{"role": "user", "content": ...}]) or `prompt_token_ids`.
        `params`: GenerateRequest fields (max_new_tokens, temperature, top_p, top_k, seed,
        stop, priority, request_id, model). `timeout` bounds the whole stream, resumes
        included. A greedy call is sent with `x-meshlm-mirror: safe` (its first attempt;
        resumes never) unless `mirror=False` (module doc). Raises InvalidArgument at once for
        a bad request; while iterating, a MeshlmError for a failure a resume cannot fix
        (Unauthenticated, PermissionDenied, RateLimited, DeadlineExceeded...), StreamLost once
        the resumes are spent."""
        progress = self.progress(
            prompt,
            messages,
            prompt_token_ids,
            params,
            timeout=timeout,
            metadata=metadata,
            mirror=mirror,
        )
        return Stream(self, progress)

    def complete(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[ChatMessage | dict[str, str]] | None = None,
        timeout: float | None = None,
        metadata: Metadata = (),
        mirror: bool = True,
        **params: Any,
    ) -> Completion:
        """The whole answer at once: generate(...).result() (`mirror` as generate's)."""
        stream = self.generate(
            prompt, messages=messages, timeout=timeout, metadata=metadata, mirror=mirror, **params
        )
        return stream.result()

    def chat(
        self,
        messages: Sequence[ChatMessage | dict[str, str]],
        *,
        timeout: float | None = None,
        metadata: Metadata = (),
        mirror: bool = True,
        **params: Any,
    ) -> Completion:
        """The assistant's whole reply to `messages` ([{"role": ..., "content": ...}]); append
        {"role": "assistant", "content": reply.text} and the next user message to go on.
        `mirror` as generate's."""
        return self.complete(
            messages=messages, timeout=timeout, metadata=metadata, mirror=mirror, **params
        )


class Stream:
    """An iterator of TokenChunk; `token_ids` (all delivered), `resumes` (its Resume events) and
    `replicas` (each replica that served part of it) are readable during and after it."""

    def __init__(self, caller: Caller, progress: Progress) -> None:
        self.caller, self.request, self.progress = caller, progress.request, progress
        self.token_ids = progress.token_ids
        self.resumes = progress.resumes
        self.replicas = progress.replicas
        self._gen = self._run()

    def __iter__(self) -> Iterator[TokenChunk]:
        return self

    def __next__(self) -> TokenChunk:
        return next(self._gen)

    def close(self) -> None:
        """Cancel the stream (never resumed after this)."""
        self._gen.close()

    def result(self) -> Completion:
        """Read the rest of the stream; the whole answer."""
        for _ in self:
            pass
        return self.progress.completion()

    def _run(self) -> Iterator[TokenChunk]:
        p = self.progress
        while True:
            request, timeout, md = p.attempt()
            call = self.caller.client.generate_raw(request, timeout=timeout, metadata=md)
            attempt = _Attempt(call)
            try:
                failure = yield from self._consume(attempt)
            finally:
                call.cancel()  # a no-op once the stream ended; on close: the caller's cancel
            if failure is None:
                return
            p.failed(failure, attempt.headers)

    def _consume(self, attempt: _Attempt) -> Iterator[TokenChunk]:
        """Yield this attempt's chunks; return None when it finished, else why it failed."""
        p = self.progress
        while True:
            try:
                event = attempt.events.get(timeout=p.wait())
            except queue.Empty:
                event = SILENT
            out = p.event(*event)
            if isinstance(out, Ended):
                return out.failure
            if out is not None:
                yield out


class _Attempt:
    """One call read on a thread, so that the stream's gaps can be timed: its events (core.py)
    each with its arrival time (the caller's own pace never counts as a gap)."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.headers: dict[str, str] = {}
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True, name="meshlm-caller").start()

    def _read(self) -> None:
        put = self.events.put
        try:
            self.headers = string_headers(self.call.initial_metadata())
            put(("headers", self.headers, time.monotonic()))
            for buf in self.call:
                put(("chunk", buf, time.monotonic()))
            put(("end", None, time.monotonic()))
        except grpc.RpcError as e:
            put(("error", e, time.monotonic()))

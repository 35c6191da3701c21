"""The Python client of the mesh: generate (streaming), complete, chat, model info, with typed
errors (meshlm.errors); a stream survives a replica that stalls or dies. `meshlm.client` is the
documented entry point (it also has AsyncCaller, the same API on asyncio).

    from meshlm.client import Caller

    with Caller("127.0.0.1:15001", api_key=KEY, authority="llm") as llm:
        for chunk in llm.generate(messages=[{"role": "user", "content": "Hi"}]):
            print(chunk.text_delta, end="")

Envoy retries a call only before its response headers; after them only the caller holds the
tokens already delivered (issue 10). So a stream that stalls (`consecutive` inter-token gaps over
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
and is not delayed (issue 18). `mirror=False` leaves a call unmarked (a call that must not run
twice); sampled calls and resumed attempts are never marked. The OpenAI HTTP API's calls are
never marked (the mesh mirrors gRPC calls only).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from opentelemetry import trace

from meshlm.errors import DeadlineExceeded, InvalidArgument, StreamLost, from_rpc_error
from model_runtime.serving.client import (
    MIRROR_HEADER,
    Client,
    Metadata,
    generate_request,
    mirror_safe,
)
from schemas import codec
from schemas.codec import ChatMessage, GenerateRequest, ModelInfo, TokenChunk
from xds_server.mesh import STALL_HEADER, VERSION_HEADER, Stall

log = logging.getLogger("meshlm.caller")

REPLICA_HEADER = "x-meshlm-replica"
# A failure of the path or the replica, not of the request: worth a resume once tokens flowed.
# CANCELLED here is a reset the caller did not ask for (its own close never reaches this).
RESUMABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DATA_LOSS,
    }
)

__all__ = ["Caller", "Completion", "Resume", "Stall", "Stream", "StreamLost"]


@dataclasses.dataclass(frozen=True)
class Resume:
    """One resume of a stream (its trace event): why, from which replica and version, and how
    many tokens the caller already had."""

    reason: str
    replica: str
    version: str
    delivered: int


@dataclasses.dataclass(frozen=True)
class Completion:
    """A whole answer: its text and token ids, why it ended ("stop", "length"...), the time to
    its first token (microseconds, as the runtime measured it), the replicas that served it and
    the resumes it took."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    ttft_us: int | None
    replicas: list[str]
    resumes: list[Resume]


def build_request(
    prompt: str | None,
    messages: Sequence[ChatMessage | dict[str, str]] | None,
    prompt_token_ids: Sequence[int] | None,
    params: dict[str, Any],
) -> GenerateRequest:
    """A validated GenerateRequest; InvalidArgument naming the field, before anything is sent."""
    try:
        return generate_request(prompt, messages, prompt_token_ids, params)
    except TypeError as e:  # an unknown parameter or message field
        raise InvalidArgument(str(e)) from None
    except ValueError as e:  # codec.WireError: names the field
        raise InvalidArgument(str(e)) from e


class CallerBase:
    """What Caller and AsyncCaller share: the stall thresholds in force and the resume count."""

    def __init__(self, stall: Stall | None) -> None:
        self.explicit = stall
        self.learned: Stall | None = None  # from the route's x-meshlm-stall header
        self.resumes = 0  # over every stream of this caller
        self._lock = threading.Lock()

    @property
    def stall(self) -> Stall:
        """The thresholds in force: explicit, else the mesh's, else the defaults."""
        return self.explicit or self.learned or Stall()

    def _learn(self, headers: dict[str, str]) -> None:
        value = headers.get(STALL_HEADER)
        if value is None or self.explicit is not None:
            return
        try:
            self.learned = Stall.from_header(value)
        except ValueError as e:
            log.warning("ignoring the route's stall policy: %s", e)

    def _count(self) -> None:
        with self._lock:
            self.resumes += 1


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
        super().__init__(stall)
        self.client = Client(target, api_key=api_key, authority=authority, metadata=metadata)

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
        req = build_request(prompt, messages, prompt_token_ids, params)
        mark = mirror_safe(req, mirror, self.client.metadata, metadata)
        return Stream(self, req, timeout, list(metadata), mirror=mark)

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


class Progress:
    """One stream's state across its attempts, and the resume decisions; Stream and AsyncStream
    only move the bytes."""

    def __init__(
        self,
        caller: CallerBase,
        request: GenerateRequest,
        timeout: float | None,
        md: list,
        mirror: bool = False,
    ) -> None:
        self.caller, self.request, self.metadata = caller, request, md
        self.mirror = mirror  # x-meshlm-mirror: safe on the first attempt (a resume is not)
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.token_ids: list[int] = []
        self.resumes: list[Resume] = []
        self.replicas: list[str] = []
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.ttft_us: int | None = None
        self._next_index = 0
        self._avoid, self._version = "", ""

    def attempt(self) -> tuple[bytes, float | None, list]:
        """(request, timeout, metadata) of the next attempt; DeadlineExceeded when none is left."""
        remaining = None if self.deadline is None else self.deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise self.expired()
        req = self.request
        if self.resumes:
            req = dataclasses.replace(
                req,
                resume_token_ids=list(self.token_ids),
                resume_index=self._next_index,
                avoid_replica=self._avoid,
            )
        md = self.metadata + ([(VERSION_HEADER, self._version)] if self._version else [])
        if self.mirror and not self.resumes:
            md.append((MIRROR_HEADER, "safe"))
        self._last, self._slow, self._first = time.monotonic(), 0, True
        return codec.encode_generate_request(req), remaining, md

    def wait(self) -> float | None:
        """Seconds to wait for this attempt's next event before it counts as stalled."""
        stall = self.caller.stall
        # Before an attempt's first token the wait is queueing and prefill, not a stall: the
        # caller-side route's per_try_idle_timeout (the hard limit) retries a silent host
        # there, before any header. After it the hard limit is checked one gap late, so that
        # the same Envoy timeout resets the stream first and the stall counts in Envoy's
        # stats and outlier detection; this check is the backstop.
        wait = stall.gap if self._slow + 1 >= stall.consecutive else stall.hard_limit + stall.gap
        until = math.inf if self._first else self._last + wait
        if self.deadline is not None:
            until = min(until, self.deadline)
        return None if until == math.inf else max(0.0, until - time.monotonic())

    def silent(self) -> str:
        """No event within wait(): why the attempt failed; DeadlineExceeded if that passed."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise self.expired()
        return f"stalled: no token for {time.monotonic() - self._last:.1f}s" + (
            f" after {self._slow} slow gaps" if self._slow else ""
        )

    def headers(self, headers: dict[str, str]) -> None:
        self.caller._learn(headers)
        replica = headers.get(REPLICA_HEADER)
        if replica:
            self.replicas.append(replica)

    def error(self, e: grpc.RpcError) -> str:
        """Why a failed attempt is worth a resume; else raises its typed error."""
        if e.code() in RESUMABLE and (self.token_ids or self.resumes):
            return f"{e.code().name}: {e.details() or ''}".rstrip(": ")
        raise from_rpc_error(e) from e

    def chunk(self, buf: bytes, at: float) -> TokenChunk:
        chunk = codec.decode_token_chunk(buf)
        if len(chunk.token_ids):
            if not self._first:
                self._slow = self._slow + 1 if at - self._last > self.caller.stall.gap else 0
            self._first = False
            self._last = at
            self.token_ids.extend(int(t) for t in chunk.token_ids)
        self._next_index = chunk.index + 1
        self.text.append(chunk.text_delta)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.ttft_us = chunk.ttft_us if self.ttft_us is None else self.ttft_us
        return chunk

    def failed(self, failure: str, headers: dict[str, str]) -> None:
        """Record a resume after the attempt with `headers` failed; StreamLost when spent."""
        replica = headers.get(REPLICA_HEADER, "")
        self._version = headers.get(VERSION_HEADER, self._version)
        # Unknown when the attempt failed before its headers (a refusal: every other host
        # was down or ejected): then the next try may go anywhere, the same replica too.
        self._avoid = replica
        stall = self.caller.stall
        if len(self.resumes) >= stall.max_resumes:
            raise StreamLost(
                f"stream lost: {failure} (replica {replica or '?'}); gave up after "
                f"{len(self.resumes)} resumes (max_resumes {stall.max_resumes}), "
                f"{len(self.token_ids)} tokens delivered"
            )
        event = Resume(failure, replica, self._version, len(self.token_ids))
        self.resumes.append(event)
        self.caller._count()
        log.info(
            "stream %s resumed (%d of at most %d): %s on replica %s, %d tokens delivered",
            self.request.request_id or "-",
            len(self.resumes),
            stall.max_resumes,
            failure,
            replica or "?",
            event.delivered,
        )
        trace.get_current_span().add_event(
            "meshlm.stream.resumed", dataclasses.asdict(event) | {"n": len(self.resumes)}
        )

    def expired(self) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"deadline passed with {len(self.token_ids)} tokens delivered (not resumed)"
        )

    def completion(self) -> Completion:
        return Completion(
            text="".join(self.text),
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            ttft_us=self.ttft_us,
            replicas=list(self.replicas),
            resumes=list(self.resumes),
        )


class Stream:
    """An iterator of TokenChunk; `token_ids` (all delivered), `resumes` (its Resume events) and
    `replicas` (each replica that served part of it) are readable during and after it."""

    def __init__(
        self,
        caller: Caller,
        request: GenerateRequest,
        timeout: float | None,
        md: list,
        mirror: bool = False,
    ) -> None:
        self.caller, self.request = caller, request
        self.progress = Progress(caller, request, timeout, md, mirror)
        self.token_ids = self.progress.token_ids
        self.resumes = self.progress.resumes
        self.replicas = self.progress.replicas
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
                kind, value, at = attempt.events.get(timeout=p.wait())
            except queue.Empty:
                return p.silent()
            if kind == "headers":
                p.headers(value)
            elif kind == "error":
                return p.error(value)
            elif kind == "end":
                return None
            else:
                yield p.chunk(value, at)


class _Attempt:
    """One call read on a thread, so that the stream's gaps can be timed: the events are
    ("headers", dict), ("chunk", bytes), ("end", None), ("error", grpc.RpcError), each with its
    arrival time (the caller's own pace never counts as a gap)."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.headers: dict[str, str] = {}
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True, name="meshlm-caller").start()

    def _read(self) -> None:
        put = self.events.put
        try:
            self.headers = {
                k: v for k, v in self.call.initial_metadata() or () if isinstance(v, str)
            }
            put(("headers", self.headers, time.monotonic()))
            for buf in self.call:
                put(("chunk", buf, time.monotonic()))
            put(("end", None, time.monotonic()))
        except grpc.RpcError as e:
            put(("error", e, time.monotonic()))

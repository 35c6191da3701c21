"""The Python API for callers: streaming generate that survives a replica that stalls or dies.

    from meshlm.caller import Caller

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
resumes the stream ends with `StreamLost` (a grpc.RpcError, UNAVAILABLE). A stream the caller
closed, or whose deadline passed, is never resumed.

The thresholds come from the mesh file's `services.<name>.stall` block, which the caller-side
route sends as the `x-meshlm-stall` response header; `stall=Stall(...)` overrides it. Without a
mesh (a runtime called directly) the defaults apply.
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

from model_runtime.client import Client, Metadata
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

__all__ = ["Caller", "Resume", "Stall", "Stream", "StreamLost"]


class _Status(grpc.RpcError):
    """An error of this library shaped like a call's: code() and details()."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class StreamLost(_Status):
    """The stream failed again after `max_resumes` resumes: UNAVAILABLE, with why."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, details)


@dataclasses.dataclass(frozen=True)
class Resume:
    """One resume of a stream (its trace event): why, from which replica and version, and how
    many tokens the caller already had."""

    reason: str
    replica: str
    version: str
    delivered: int


class Caller:
    """One channel to a caller-side sidecar (or a runtime); thread-safe, reuse it."""

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
        self.explicit = stall
        self.learned: Stall | None = None  # from the route's x-meshlm-stall header
        self.resumes = 0  # over every stream of this caller
        self._lock = threading.Lock()

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Caller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def info(self, *, timeout: float | None = 10.0, metadata: Metadata = ()) -> ModelInfo:
        return self.client.info(timeout=timeout, metadata=metadata)

    @property
    def stall(self) -> Stall:
        """The thresholds in force: explicit, else the mesh's, else the defaults."""
        return self.explicit or self.learned or Stall()

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[ChatMessage | dict[str, str]] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        metadata: Metadata = (),
        **params: Any,
    ) -> Stream:
        """Stream decoded chunks, resuming on another replica when one stalls or fails.
        `params`: GenerateRequest fields (max_new_tokens, temperature, top_p, top_k, seed,
        stop, priority, request_id, model). `timeout` bounds the whole stream, resumes
        included. Raises grpc.RpcError for a failure that a resume cannot fix (a denial, bad
        input, the deadline), StreamLost once the resumes are spent."""
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
        return Stream(self, req, timeout, list(metadata))

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


class Stream:
    """An iterator of TokenChunk; `token_ids` (all delivered), `resumes` (its Resume events) and
    `replicas` (each replica that served part of it) are readable during and after it."""

    def __init__(
        self, caller: Caller, request: GenerateRequest, timeout: float | None, md: list
    ) -> None:
        self.caller, self.request, self.metadata = caller, request, md
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.token_ids: list[int] = []
        self.resumes: list[Resume] = []
        self.replicas: list[str] = []
        self._next_index = 0
        self._gen = self._run()

    def __iter__(self) -> Iterator[TokenChunk]:
        return self

    def __next__(self) -> TokenChunk:
        return next(self._gen)

    def close(self) -> None:
        """Cancel the stream (never resumed after this)."""
        self._gen.close()

    def _run(self) -> Iterator[TokenChunk]:
        avoid, version = "", ""
        while True:
            remaining = None if self.deadline is None else self.deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise _deadline(self)
            req = self.request
            if self.resumes:
                req = dataclasses.replace(
                    req,
                    resume_token_ids=list(self.token_ids),
                    resume_index=self._next_index,
                    avoid_replica=avoid,
                )
            md = self.metadata + ([(VERSION_HEADER, version)] if version else [])
            call = self.caller.client.generate_raw(
                codec.encode_generate_request(req), timeout=remaining, metadata=md
            )
            attempt = _Attempt(call)
            try:
                failure = yield from self._consume(attempt)
            finally:
                call.cancel()  # a no-op once the stream ended; on close: the caller's cancel
            if failure is None:
                return
            replica = attempt.headers.get(REPLICA_HEADER, "")
            version = attempt.headers.get(VERSION_HEADER, version)
            # Unknown when the attempt failed before its headers (a refusal: every other host
            # was down or ejected): then the next try may go anywhere, the same replica too.
            avoid = replica
            stall = self.caller.stall
            if len(self.resumes) >= stall.max_resumes:
                raise StreamLost(
                    f"stream lost: {failure} (replica {replica or '?'}); gave up after "
                    f"{len(self.resumes)} resumes (max_resumes {stall.max_resumes}), "
                    f"{len(self.token_ids)} tokens delivered"
                )
            event = Resume(failure, replica, version, len(self.token_ids))
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

    def _consume(self, attempt: _Attempt) -> Iterator[TokenChunk]:
        """Yield this attempt's chunks; return None when it finished, else why it failed."""
        last = time.monotonic()
        slow = 0  # inter-token gaps over `gap` in a row
        first = True
        while True:
            stall = self.caller.stall
            # Before an attempt's first token the wait is queueing and prefill, not a stall: the
            # caller-side route's per_try_idle_timeout (the hard limit) retries a silent host
            # there, before any header. After it the hard limit is checked one gap late, so that
            # the same Envoy timeout resets the stream first and the stall counts in Envoy's
            # stats and outlier detection; this check is the backstop.
            wait = stall.gap if slow + 1 >= stall.consecutive else stall.hard_limit + stall.gap
            until = math.inf if first else last + wait
            if self.deadline is not None:
                until = min(until, self.deadline)
            timeout = None if until == math.inf else max(0.0, until - time.monotonic())
            try:
                kind, value, at = attempt.events.get(timeout=timeout)
            except queue.Empty:
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    raise _deadline(self) from None
                return f"stalled: no token for {time.monotonic() - last:.1f}s" + (
                    f" after {slow} slow gaps" if slow else ""
                )
            if kind == "headers":
                self.caller._learn(value)
                replica = value.get(REPLICA_HEADER)
                if replica:
                    self.replicas.append(replica)
                continue
            if kind == "error":
                if value.code() in RESUMABLE and (self.token_ids or self.resumes):
                    return f"{value.code().name}: {value.details() or ''}".rstrip(": ")
                raise value
            if kind == "end":
                return None
            chunk = codec.decode_token_chunk(value)
            if len(chunk.token_ids):
                if not first:
                    slow = slow + 1 if at - last > stall.gap else 0
                first = False
                last = at
                self.token_ids.extend(int(t) for t in chunk.token_ids)
            self._next_index = chunk.index + 1
            yield chunk


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


def _deadline(stream: Stream) -> grpc.RpcError:
    return _Status(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"deadline passed with {len(stream.token_ids)} tokens delivered (not resumed)",
    )

"""The I/O-free core of the Python client, shared by Caller (threads, meshlm/client/caller.py)
and AsyncCaller (asyncio, meshlm/client/aio.py): building a request, a stream's progress across
its attempts, every resume decision, and the mapping of gRPC errors to meshlm.client.errors.

The callers only move bytes and time the waits. Each attempt of a stream is read as events
`(kind, value, arrival time)`: ("headers", dict), ("chunk", bytes), ("end", None),
("error", grpc.RpcError), or SILENT when nothing came within Progress.wait(); Progress.event()
turns each into a chunk to hand out, nothing (headers), or Ended (the attempt is over).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
from opentelemetry import trace

from mesh_common.headers import (
    MIRROR_HEADER,
    MIRROR_SAFE,
    REPLICA_HEADER,
    STALL_HEADER,
    VERSION_HEADER,
)
from meshlm.client.errors import DeadlineExceeded, InvalidArgument, StreamLost, from_rpc_error
from model_runtime.serving.client import Metadata, generate_request, mirror_safe
from schemas import codec
from schemas.codec import ChatMessage, GenerateRequest, TokenChunk
from xds_server.mesh import Stall

# The name users filter the resume lines by.
log = logging.getLogger("meshlm.caller")

# A failure of the path or the replica, not of the request: worth a resume once a replica took
# the stream (its response headers came) or tokens flowed. Before any header the caller-side
# route's own retry handles it (retry_on reset), and a refusal there is the request's.
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

# The event of an attempt that stayed silent for Progress.wait().
SILENT = ("silent", None, 0.0)


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


@dataclasses.dataclass(frozen=True)
class Ended:
    """An attempt is over: finished (`failure` None), or failed for the reason given."""

    failure: str | None


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


def string_headers(metadata: Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    """A call's response headers as a dict (binary `-bin` values left out)."""
    return {k: v for k, v in metadata or () if isinstance(v, str)}


class CallerBase:
    """What Caller and AsyncCaller share: the headers sent with every call, the stall
    thresholds in force and the resume count."""

    def __init__(self, stall: Stall | None, metadata: list[tuple[str, str]]) -> None:
        self.metadata = metadata  # x-api-key and the headers given for every call
        self.explicit = stall
        self.learned: Stall | None = None  # from the route's x-meshlm-stall header
        self.resumes = 0  # over every stream of this caller
        self._lock = threading.Lock()

    @property
    def stall(self) -> Stall:
        """The thresholds in force: explicit, else the mesh's, else the defaults."""
        return self.explicit or self.learned or Stall()

    def progress(
        self,
        prompt: str | None,
        messages: Sequence[ChatMessage | dict[str, str]] | None,
        prompt_token_ids: Sequence[int] | None,
        params: dict[str, Any],
        *,
        timeout: float | None,
        metadata: Metadata,
        mirror: bool,
    ) -> Progress:
        """A new stream's Progress: its request validated (InvalidArgument at once), `metadata`
        its own headers (sent after the caller's), marked safe to mirror where mirror_safe says
        so."""
        req = build_request(prompt, messages, prompt_token_ids, params)
        mark = mirror_safe(req, mirror, self.metadata, metadata)
        return Progress(self, req, timeout, list(metadata), mark)

    def learn(self, headers: dict[str, str]) -> None:
        """Take the route's stall thresholds from a response's headers (unless explicit)."""
        value = headers.get(STALL_HEADER)
        if value is None or self.explicit is not None:
            return
        try:
            self.learned = Stall.from_header(value)
        except ValueError as e:
            log.warning("ignoring the route's stall policy: %s", e)

    def count_resume(self) -> None:
        with self._lock:
            self.resumes += 1


class Progress:
    """One stream's state across its attempts, and the resume decisions."""

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
        self._answered = False

    def attempt(self) -> tuple[bytes, float | None, list]:
        """(request, timeout, metadata) of the next attempt (the headers the caller sends with
        every call go before this metadata); DeadlineExceeded when no time is left."""
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
            md.append((MIRROR_HEADER, MIRROR_SAFE))
        self._last, self._slow, self._first = time.monotonic(), 0, True
        self._answered = False  # a replica's response headers came on this attempt
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

    def event(self, kind: str, value: Any, at: float) -> TokenChunk | Ended | None:
        """One event of the current attempt: the chunk to hand out, None for its headers, or
        Ended. Raises the typed error of a failure a resume cannot fix."""
        if kind == "chunk":
            return self._chunk(value, at)
        if kind == "headers":
            self._headers(value)
            return None
        if kind == "end":
            return Ended(None)
        if kind == "error":
            return Ended(self._error(value))
        return Ended(self._silent())

    def _silent(self) -> str:
        """No event within wait(): why the attempt failed; DeadlineExceeded if that passed."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise self.expired()
        return f"stalled: no token for {time.monotonic() - self._last:.1f}s" + (
            f" after {self._slow} slow gaps" if self._slow else ""
        )

    def _headers(self, headers: dict[str, str]) -> None:
        self.caller.learn(headers)
        replica = headers.get(REPLICA_HEADER)
        if replica:
            self.replicas.append(replica)
            self._answered = True

    def _error(self, e: grpc.RpcError) -> str:
        """Why a failed attempt is worth a resume; else raises its typed error."""
        # A stream a replica took and that broke before its first token (the host cut off
        # after the headers: Envoy's idle timeout resets it, and no retry follows headers) is
        # resumed like one that broke later, with nothing delivered.
        if e.code() in RESUMABLE and (self.token_ids or self.resumes or self._answered):
            return f"{e.code().name}: {e.details() or ''}".rstrip(": ")
        raise from_rpc_error(e) from e

    def _chunk(self, buf: bytes, at: float) -> TokenChunk:
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
        self.caller.count_resume()
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

"""The gRPC service around the engine: bytes in, FlatBuffers out, generic handlers.

    /meshlm.inference.v1.Inference/Generate   GenerateRequest -> stream TokenChunk
    /meshlm.inference.v1.Inference/Info       InfoRequest     -> ModelInfo
    /grpc.health.v1.Health/{Check,Watch}      NOT_SERVING until a model serves, and on drain
    /xds.service.orca.v3.OpenRcaService/StreamCoreMetrics   ORCA load reports (orca.py), in
                                                            workers of their own, bounded

A mirrored copy of a call (a quality-gated rollout's) arrives with `x-meshlm-shadow: 1`, which only
the canary's sidecar sets (for authorities suffixed `-shadow`). It must be greedy (else it is
refused before any generation: a mis-marked call costs nothing), it runs at the lowest priority, it
is recorded with `shadow: true` (model_runtime/serving/records.py) and it counts only in the shadow
counter, never in the series the rollout's traffic gates read (model_runtime/serving/telemetry.py).

The engine schedules by the tenant in `x-meshlm-tenant` (fair share, per-tenant limits). Behind
the mesh only the sidecar's authz filter sets it (it drops client copies); a runtime reached
directly believes whatever a caller sends, so it listens on loopback (`--host 127.0.0.1`) for
its sidecar alone.

`Runtime` owns the grpc.Server. It starts before the model is loaded (so health checks answer
NOT_SERVING while weights load), serves once `set_model()` hands it a started engine, and drains
on `shutdown()`: NOT_SERVING first, then `server.stop(grace)` lets in-flight streams finish.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mesh_common.headers import (
    PRIORITY_HEADER,
    PROMPT_TOKENS_HEADER,
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
    SHADOW_HEADER,
    TENANT_HEADER,
    TOKEN_BUDGET_HEADER,
)
from model_runtime.serving.budgets import BudgetError, BudgetExceeded, Budgets, Held
from model_runtime.serving.faults import Faults
from model_runtime.serving.orca import OrcaService
from model_runtime.serving.records import Records
from model_runtime.serving.telemetry import Telemetry
from schemas import codec
from schemas.codec import ErrorInfo, Limits, WireError

log = logging.getLogger(__name__)

SERVICE = "meshlm.inference.v1.Inference"
GENERATE = f"/{SERVICE}/Generate"
INFO = f"/{SERVICE}/Info"
PRIORITY_NAMES = {"low": -1, "normal": 0, "default": 0, "high": 1}
_POLL_S = 0.25  # how often a waiting stream re-checks deadline and liveness
_CANCELLED = object()  # wakes a stream whose RPC ended (client cancel, deadline, drain)
HEALTH_WORKERS = 4  # workers beside calls and report streams, for health checks
# The gRPC port is for the runtime's own sidecar (a few HTTP/2 connections) and local tools;
# grpc-core closes a connection past the bound as it arrives, one that has not spoken HTTP/2
# within the handshake timeout, and one without a call for GRPC_MAX_IDLE_S (Envoy reconnects).
GRPC_MAX_CONNECTIONS = 64
GRPC_HANDSHAKE_TIMEOUT_S = 10
GRPC_MAX_IDLE_S = 300


class _Abort(Exception):
    def __init__(
        self, code: grpc.StatusCode, message: str, trailers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.trailers = code, message, trailers


def _is_shadow(metadata: dict[str, Any]) -> bool:
    """Any value but empty or "0" counts: a marked copy is never taken for a caller's call."""
    return str(metadata.get(SHADOW_HEADER, "")).strip() not in ("", "0")


def _priority(req_priority: int | None, metadata: dict[str, Any]) -> int:
    """The scheduling priority: what the body asks, never above the verified header.

    The sidecar's authz filter drops any client-sent `x-meshlm-priority` and sets the tenant's
    own, so that header is the most this request may get; the body's `priority` may only lower
    it. Without the header (native authz mode, which cannot set it, or a call
    that bypassed the mesh) the ceiling is the default level, 0 ("normal"). A header that is not
    a priority fails closed to the lowest level, -1000.
    """
    raw = str(metadata.get(PRIORITY_HEADER, "")).strip().lower()
    if not raw:
        ceiling = 0
    elif raw in PRIORITY_NAMES:
        ceiling = PRIORITY_NAMES[raw]
    else:
        try:
            ceiling = max(-1000, min(1000, int(raw)))
        except ValueError:
            ceiling = -1000
    return ceiling if req_priority is None else min(req_priority, ceiling)


def _usage(stats: dict[str, Any]) -> tuple[str, int, int] | None:
    """(model id, prompt tokens, completion tokens) of a call the engine ran: it streamed a
    token, or ended OK (a call shed from the queue or refused before it ran uses nothing)."""
    if "token_ids" not in stats or not (stats["token_ids"] or stats["code"] == "OK"):
        return None
    return stats["model"], stats.get("prompt_tokens", 0), len(stats["token_ids"])


def _record_key(req: codec.GenerateRequest, md: dict[str, Any]) -> str:
    return req.request_id or str(md.get(REQUEST_ID_HEADER, ""))


def _check_shadow(req: codec.GenerateRequest, md: dict[str, Any]) -> None:
    """A mirrored copy is refused before any generation unless it is greedy and can be joined:
    only its record is of use, and only a greedy answer compares."""
    why = None
    if req.temperature > 0:
        why = f"temperature {req.temperature:g}"
    elif req.resume_token_ids is not None and len(req.resume_token_ids):
        why = "resume_token_ids (a resumed stream)"
    elif not _record_key(req, md):
        why = f"no request_id in the body nor {REQUEST_ID_HEADER} header to record it under"
    if why is not None:
        raise _Abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{SHADOW_HEADER}: a mirrored call must be greedy (temperature 0, no resume) and "
            f"carry a request id; this one has {why}: refused before generation",
        )


class InferenceService:
    """The two RPC handlers; `loaded` and `engine` come from model_runtime.loading.loader /
    .engine."""

    def __init__(
        self,
        loaded: Any,
        engine: Any,
        *,
        telemetry: Telemetry,
        faults: Faults | None = None,
        limits: Limits | None = None,
        replica_id: str = "",
        served_model_names: Sequence[str] = (),
        records: Records | None = None,
        budgets: Budgets | None = None,
    ) -> None:
        self.loaded, self.engine = loaded, engine
        self.budgets = budgets or Budgets()
        self.records = records  # greedy calls' outputs by request id
        self.replica_id = replica_id
        self.telemetry = telemetry
        self.faults = faults or Faults()
        info = loaded.info
        vocab = getattr(loaded.tokenizer, "vocab_size", None)
        self.limits = limits or Limits(context_length=info.context_length, vocab_size=vocab)
        self.model_info = codec.ModelInfo(
            info.name,
            info.precision,
            info.version,
            info.context_length,
            vocab or 0,
            # what load() chose and built for this machine (kernels.choose), not a fresh guess
            compute_dtype=info.compute_dtype,
            compute=info.compute,
            kernels=info.kernels,
        )
        self._info_bytes = codec.encode_model_info(self.model_info)
        # The names GET /v1/models lists (vLLM's --served-model-name, e.g. the mesh service's;
        # else the file's slug): a call's `model` may be one of them, the slug, the model's own
        # name or its version.
        own = [info.model_id or info.name, info.name, info.version]
        self.served_names = list(served_model_names) or own[:1]
        self._accepted = {n.lower() for n in [*self.served_names, *own]}

    # --- Info ------------------------------------------------------------------------------

    def info(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        md = dict(context.invocation_metadata())
        with self.telemetry.span("Info", md):
            try:
                codec.decode_info_request(request)
            except WireError as e:
                self.telemetry.record("Info", "INVALID_ARGUMENT")
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            self.telemetry.record("Info", "OK")
            return self._info_bytes

    # --- Generate --------------------------------------------------------------------------

    def generate(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        started = time.monotonic()
        if self.replica_id:  # also on refusals, which answer with trailers only
            context.set_trailing_metadata(((REPLICA_HEADER, self.replica_id),))
        md = dict(context.invocation_metadata())
        shadow = _is_shadow(md)
        stats: dict[str, Any] = {"code": "OK", "ttft": None, "tpot": None, "shadow": shadow}
        tenant = str(md.get(TENANT_HEADER, ""))
        with self.telemetry.span("Generate", md) as span:
            if shadow:
                span.set_attribute("meshlm.shadow", True)
            try:
                yield from self._generate(request, context, md, span, started, stats)
            except _Abort as a:
                if a.trailers:  # set_trailing_metadata replaces: keep the replica's
                    replica = ((REPLICA_HEADER, self.replica_id),) if self.replica_id else ()
                    context.set_trailing_metadata((*replica, *a.trailers))
                stats["code"] = a.code.name
                span.set_attribute("rpc.grpc.status_code", a.code.value[0])
                e2e = time.monotonic() - started
                self.telemetry.record("Generate", stats["code"], e2e_s=e2e, tenant=tenant,
                                      shadow=shadow, usage=_usage(stats))  # fmt: skip
                context.abort(a.code, a.message)
            except Exception:
                # grpcio would answer UNKNOWN; say INTERNAL and keep the reason out of the reply.
                log.exception("Generate failed")
                e2e = time.monotonic() - started
                self.telemetry.record("Generate", "INTERNAL", e2e_s=e2e, tenant=tenant,
                                      shadow=shadow, usage=_usage(stats))  # fmt: skip
                context.abort(grpc.StatusCode.INTERNAL, "internal error in the runtime")
            self.telemetry.record("Generate", stats["code"], stats["ttft"], stats["tpot"],
                                  e2e_s=time.monotonic() - started, tenant=tenant,
                                  shadow=shadow, usage=_usage(stats))  # fmt: skip

    def _prompt_ids(self, req: codec.GenerateRequest) -> list[int]:
        tok = self.loaded.tokenizer
        if req.prompt_token_ids is not None:
            return req.prompt_token_ids.tolist()
        if req.prompt is not None:
            return tok.encode(req.prompt)
        messages = [{"role": m.role, "content": m.content} for m in req.messages or ()]
        rendered = tok.apply_chat_template(messages)
        return tok.encode(rendered) if isinstance(rendered, str) else list(rendered)

    def _poison_fault(self, req: codec.GenerateRequest, context: grpc.ServicerContext) -> None:
        """`--fault-poison`: a query of death exits, stalls or fails."""
        texts = [req.prompt or ""] + [m.content for m in req.messages or ()]
        if not self.faults.poisoned(texts):
            return
        action = self.faults.poison_action
        if action == "exit":
            self.faults.poison_exit()
        if action == "stall":
            log.warning("fault injected (--fault-poison): a request matched; never answering it")
            while context.is_active():
                time.sleep(0.1)
        raise _Abort(grpc.StatusCode.INTERNAL, "fault injected (--fault-poison)")

    def _generate(
        self,
        request: bytes,
        context: grpc.ServicerContext,
        md: dict[str, Any],
        span: Any,
        started: float,
        stats: dict[str, Any],
    ) -> Iterator[bytes]:
        if self.faults.should_fail():
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "fault injected (--fault-error-percent)")
        try:
            req = codec.decode_generate_request(request, self.limits)
        except WireError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if stats["shadow"]:
            _check_shadow(req, md)
        if req.avoid_replica and req.avoid_replica == self.replica_id:
            # Before any response header, so the sidecar's retry (previous_hosts) may move the
            # call to another host; after headers nothing in Envoy can.
            raise _Abort(
                grpc.StatusCode.UNAVAILABLE,
                f"avoid_replica: this is replica {self.replica_id!r}, which the call asks to "
                "avoid; try another replica",
            )
        if req.model and req.model.lower() not in self._accepted:
            raise _Abort(
                grpc.StatusCode.NOT_FOUND,
                f"model: {req.model!r} is not served here (this runtime serves "
                f"{', '.join(map(repr, self.served_names))})",
            )
        named = req.model.lower() if req.model else ""
        stats["model"] = next((n for n in self.served_names if n.lower() == named), None)
        stats["model"] = stats["model"] or self.served_names[0]  # usage's label: a served id
        self._poison_fault(req, context)
        tenant = md.get(TENANT_HEADER, "")
        log.debug("Generate tenant=%s request_id=%s", tenant, req.request_id)
        if tenant:
            span.set_attribute("meshlm.tenant", str(tenant))
        prompt_ids = self._prompt_ids(req)
        stats["prompt_tokens"] = len(prompt_ids)  # usage counts (the OpenAI API's too)
        if len(prompt_ids) >= self.model_info.context_length:
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt: {len(prompt_ids)} tokens leave no room in the context of "
                f"{self.model_info.context_length}",
            )
        from model_runtime.engine.engine import GenerateParams

        params = GenerateParams(
            prompt_ids=prompt_ids,
            max_new_tokens=req.max_new_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop=list(req.stop),
            resume_ids=[] if req.resume_token_ids is None else req.resume_token_ids.tolist(),
            # a shadow never delays a caller's call (and is shed first under overload)
            priority=PRIORITY_NAMES["low"] if stats["shadow"] else _priority(req.priority, md),
            tenant=str(tenant),  # the verified header only: no body field can choose it
        )
        reservation = self._reserve(md, str(tenant), stats, params)
        try:
            yield from self._run(req, md, context, span, started, stats, params)
        finally:
            if reservation is not None:
                ran = stats.get("token_ids")
                used = 0 if ran is None else stats["prompt_tokens"] + len(ran)
                self.budgets.settle(reservation, used)

    def _reserve(
        self, md: dict[str, Any], tenant: str, stats: dict[str, Any], params: Any
    ) -> Held | None:
        """Reserve prompt + max_tokens of the tenant's token budget (the verified header the
        inbound sidecar's authz filter set), or refuse the call; None where no budget applies.
        A mirrored copy was charged where the caller's call was served."""
        header = str(md.get(TOKEN_BUDGET_HEADER, ""))
        if not header or stats["shadow"]:
            return None
        room = self.model_info.context_length - len(params.prompt_ids)
        tokens = len(params.prompt_ids) + min(params.max_new_tokens, room)
        try:
            return self.budgets.reserve(tenant, header, tokens)
        except BudgetExceeded as e:
            after = () if e.retry_after_s is None else (("retry-after", str(e.retry_after_s)),)
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), after) from None
        except BudgetError as e:  # the sidecar's header: a mesh fault, refused closed
            raise _Abort(grpc.StatusCode.INTERNAL, f"{TOKEN_BUDGET_HEADER}: {e}") from None

    def _run(
        self,
        req: codec.GenerateRequest,
        md: dict[str, Any],
        context: grpc.ServicerContext,
        span: Any,
        started: float,
        stats: dict[str, Any],
        params: Any,
    ) -> Iterator[bytes]:
        from model_runtime.engine.engine import EngineFull

        events: queue.SimpleQueue = queue.SimpleQueue()
        ended = threading.Event()
        rid = uuid.uuid4().hex  # the engine's key; the client's id is only echoed back
        reply_id = req.request_id or rid
        span.set_attribute("meshlm.request_id", reply_id)

        def on_rpc_end() -> None:  # client cancel, deadline, or the stream finished
            ended.set()
            events.put(_CANCELLED)

        if not context.add_callback(on_rpc_end) or (
            self.faults.delay_ms and ended.wait(self.faults.delay_s)
        ):
            stats["code"] = "CANCELLED"  # the RPC is already over
            return
        try:
            self.engine.submit(rid, params, events.put)
            if params.resume_ids:
                self.telemetry.resumed()
        except EngineFull as e:
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except ValueError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        stats["token_ids"] = []
        try:
            yield from self._stream(
                rid, reply_id, context, events, started, stats, req.resume_index, ended
            )
            self._record(req, md, params, stats)
        finally:
            # Frees the request's KV blocks at once if it is still running (cancel, deadline,
            # drain past the grace period); a no-op for a finished request.
            self.engine.cancel(rid)

    def _record(self, req: Any, md: dict[str, Any], params: Any, stats: dict[str, Any]) -> None:
        """Keep a greedy, complete, non-resumed answer under its request id (records.py)."""
        if self.records is None or params.temperature > 0 or params.resume_ids:
            return
        if stats.get("finish") not in ("stop", "length"):
            return
        self.records.add(
            _record_key(req, md),
            params.prompt_ids,
            stats["token_ids"],
            stats["finish"],
            shadow=stats["shadow"],
        )

    def _stream(
        self,
        rid: str,
        reply_id: str,
        context: grpc.ServicerContext,
        events: queue.SimpleQueue,
        started: float,
        stats: dict[str, Any],
        first_index: int = 0,
        ended: threading.Event | None = None,
    ) -> Iterator[bytes]:
        index = first_index  # a resumed stream continues the chunk indexes
        first_at = last_at = None
        tokens = 0
        while True:
            remaining = context.time_remaining()
            try:
                ev = events.get(timeout=_POLL_S if remaining is None else min(_POLL_S, remaining))
            except queue.Empty:
                ev = None
            if ev is _CANCELLED or ev is None:
                if remaining is not None and context.time_remaining() <= 0:
                    self.engine.cancel(rid)
                    raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
                if not context.is_active():
                    self.engine.cancel(rid)
                    stats["code"] = "CANCELLED"
                    return
                continue
            now = time.monotonic()
            if ev.token_ids:
                tokens += len(ev.token_ids)
                stats["token_ids"].extend(ev.token_ids)
                if first_at is None:
                    first_at = now
                    stats["ttft"] = now - started
                    if not stats["shadow"]:
                        self.telemetry.first_token(stats["ttft"], ev.queue_wait_s)
                elif last_at is not None and not stats["shadow"]:
                    self.telemetry.tokens(now - last_at, len(ev.token_ids))
                last_at = now
            error = None
            if ev.shed:  # dropped from the queue before its first token (overload)
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, ev.error or "shed")
            if ev.finish_reason == "error":
                error = ErrorInfo(grpc.StatusCode.INTERNAL.value[0], ev.error or "engine error")
            if index == first_index:
                # With the first chunk, not earlier: until a token exists the call has no
                # response headers, so the sidecar may still retry a slow replica.
                headers = [(PROMPT_TOKENS_HEADER, str(stats.get("prompt_tokens", 0)))]
                if self.replica_id:
                    headers.append((REPLICA_HEADER, self.replica_id))
                try:
                    context.send_initial_metadata(tuple(headers))
                except grpc.RpcError:  # the client cancelled just before: not a runtime error
                    self.engine.cancel(rid)
                    stats["code"] = "CANCELLED"
                    return
            yield codec.encode_token_chunk(
                reply_id,
                index,
                ev.token_ids,
                ev.text_delta or "",
                ev.finish_reason,
                int((ev.queue_wait_s or 0.0) * 1e6),
                None if stats["ttft"] is None else int(stats["ttft"] * 1e6),
                error,
            )
            index += 1
            if ev.token_ids and self._stream_faults(
                tokens - len(ev.token_ids), tokens, ev.finish_reason is not None, ended
            ):
                self.engine.cancel(rid)  # the call ended during an injected stall
                expired = context.time_remaining() is not None and context.time_remaining() <= 0
                stats["code"] = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
                return
            if ev.finish_reason is None:
                continue
            stats["finish"] = ev.finish_reason
            if tokens > 1 and first_at is not None and last_at is not None:
                stats["tpot"] = (last_at - first_at) / (tokens - 1)
            if ev.finish_reason == "error":
                raise _Abort(grpc.StatusCode.INTERNAL, f"engine: {ev.error or 'error'}")
            if ev.finish_reason == "cancelled":
                # Cancelled by the runtime itself (drain past its grace period): retryable.
                raise _Abort(grpc.StatusCode.UNAVAILABLE, "request cancelled by the runtime")
            return

    def _stream_faults(
        self, sent_before: int, sent: int, final: bool, ended: threading.Event | None
    ) -> bool:
        """--fault-exit-after / --fault-stall-after, once a chunk's tokens were sent. Only this
        stream's delivery waits; the engine keeps decoding every stream. True if the call ended
        (cancel, deadline) during a stall."""
        if self.faults.exit_due(sent):
            self.faults.exit_hard(sent)
        stall = None if final or ended is None else self.faults.stall_s(sent_before, sent)
        if stall is None:
            return False
        log.debug("fault: stream stalls after %d tokens for %s s", sent, stall)
        return ended.wait(None if math.isinf(stall) else stall)


class Runtime:
    """A grpc.Server with health checking and, once `set_model()` ran, the Inference service."""

    def __init__(
        self,
        address: str = "127.0.0.1:0",
        *,
        max_workers: int = 96,
        telemetry: Telemetry | None = None,
        faults: Faults | None = None,
        limits: Limits | None = None,
        replica_id: str | None = None,
        served_model_names: Sequence[str] = (),
        budgets: Budgets | None = None,
    ) -> None:
        self.telemetry = telemetry or Telemetry()
        self.budgets = budgets or Budgets()
        self.telemetry.watch_budgets(self.budgets.levels)
        self.records = Records()  # served on the metrics port (records.py)
        self.served_model_names = tuple(served_model_names)
        self.faults = faults
        self.limits = limits
        self.service: InferenceService | None = None
        self.engine: Any = None
        self.health = health.HealthServicer()
        max_msg = (limits or Limits()).max_buffer_bytes
        self.orca = OrcaService(lambda: self.engine)
        # One worker per open stream. Calls (Generate, Info) may hold `max_workers` of them,
        # sized for the engine's batch plus its queue; ORCA report streams, which Envoy keeps
        # open for good, have a reserve of their own beside them (orca.py bounds their count),
        # and health checks a few more: no number of report streams takes a worker from calls.
        self.max_workers = max_workers
        self._calls = threading.BoundedSemaphore(max_workers)
        pool = max_workers + self.orca.max_streams + HEALTH_WORKERS
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=pool, thread_name_prefix="grpc"),
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", max_msg),
                ("grpc.max_allowed_incoming_connections", GRPC_MAX_CONNECTIONS),
                ("grpc.server_handshake_timeout_ms", GRPC_HANDSHAKE_TIMEOUT_S * 1000),
                ("grpc.max_connection_idle_ms", GRPC_MAX_IDLE_S * 1000),
            ],
            maximum_concurrent_rpcs=pool,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.server.add_generic_rpc_handlers((self.orca.handler(),))
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        "Generate": grpc.unary_stream_rpc_method_handler(self._generate),
                        "Info": grpc.unary_unary_rpc_method_handler(self._info),
                    },
                ),
            )
        )
        self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind gRPC address {address}")
        self.host = address.rsplit(":", 1)[0]
        self.replica_id = replica_id or self.target  # sent as x-meshlm-replica on every stream
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE):
            self.health.set(name, status)

    def start(self) -> Runtime:
        self.server.start()
        return self

    def set_model(self, loaded: Any, engine: Any) -> None:
        """Serve `loaded` through a started `engine`; health turns SERVING."""
        self.engine = engine
        self.service = InferenceService(
            loaded,
            engine,
            telemetry=self.telemetry,
            faults=self.faults,
            limits=self.limits,
            replica_id=self.replica_id,
            served_model_names=self.served_model_names,
            records=self.records,
            budgets=self.budgets,
        )
        self.records.model = loaded.model
        self.records.engine = engine  # /score's forward on the engine's thread
        self.telemetry.engine_stats = engine.stats
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s", loaded.info.version, self.target)

    def _unavailable(self, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")

    def _call_slot(self, context: grpc.ServicerContext) -> None:
        if not self._calls.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"concurrent calls: {self.max_workers} are in flight, this runtime's most",
            )

    def _generate(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        self._call_slot(context)
        try:
            if self.service is None:
                self._unavailable(context)
            assert self.service is not None
            yield from self.service.generate(request, context)
        finally:
            self._calls.release()

    def _info(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._call_slot(context)
        try:
            if self.service is None:
                self._unavailable(context)
            assert self.service is not None
            return self.service.info(request, context)
        finally:
            self._calls.release()

    def shutdown(self, grace: float = 30.0) -> None:
        """Drain: NOT_SERVING, refuse new calls, let in-flight streams finish within `grace`,
        then stop the engine."""
        self.health.enter_graceful_shutdown()
        self.orca.close()  # Envoy's report streams never end by themselves
        self.server.stop(grace).wait()
        if self.engine is not None:
            self.engine.shutdown(drain_timeout=grace)
        self.budgets.close()  # the last settles reach the control plane
        self.telemetry.shutdown()  # flushes OTLP exporters, if any

"""OpenAI-compatible HTTP on the runtime: `meshlm serve --http-port P`.

    POST /v1/chat/completions   POST /v1/completions   (stream: server-sent events, data: [DONE])
    GET  /v1/models             GET  /v1/models/{id}

Each call goes through the gRPC service's own request path, `InferenceService.generate`, with
the body translated to a FlatBuffers GenerateRequest (model_runtime/serving/openai_api.py): the same
validation, engine, scheduler, tenant (the verified `x-meshlm-tenant` header the sidecar sets),
priorities, faults and metrics as a gRPC call. `_HttpCall` is the part of a gRPC servicer
context that path uses: request headers as metadata, response headers from its metadata, abort
as an exception, and the client's disconnect as the end of the call (the engine frees the
request's KV blocks, as on a gRPC cancel). As for gRPC, a stream's response headers leave with
its first token, so a refusal before it (queue full, a bad value) is a plain HTTP error status.

HTTP/1.1 with keep-alive (a stream's body is chunked) on mesh_common/http_server.py: exact
framing (a body is read whole, content-length or chunked, or refused with the connection
closed), a bounded body, a whole-request deadline, a bounded number of connections in all and
per peer, a thread per connection. Route and readiness are checked before a body is read. Bind
loopback, as the gRPC port: behind the mesh only the sidecar may reach the runtime (its inbound
listener buffers each whole request before it comes here, so a slow body holds no slot).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

from mesh_common.headers import PROMPT_TOKENS_HEADER, TENANT_HEADER
from mesh_common.http_server import (
    REQUEST_TIMEOUT_S,
    BodyError,
    BoundedHandler,
    BoundedServer,
    peer_closed,
)
from model_runtime.serving import openai_api as api
from model_runtime.serving.openai_api import ApiError
from schemas import codec
from schemas.codec import Limits

log = logging.getLogger(__name__)
_BUSY_BODY = (
    b'{"error":{"message":"too many connections: retry later","type":"server_error",'
    b'"param":null,"code":"service_unavailable"}}'
)
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


class _Aborted(Exception):
    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class _HttpCall:
    """The grpc.ServicerContext methods `InferenceService.generate` uses, for one HTTP call."""

    def __init__(self, metadata: list[tuple[str, str]], sock: socket.socket) -> None:
        self._metadata = metadata
        self._sock = sock
        self._callbacks: list[Any] = []
        self.ended = False
        self.response_headers: dict[str, str] = {}

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def set_trailing_metadata(self, metadata: tuple) -> None:
        self.response_headers.update(metadata)

    def send_initial_metadata(self, metadata: tuple) -> None:
        self.response_headers.update(metadata)

    def abort(self, code: Any, details: str) -> None:
        raise _Aborted(code.name, details)

    def add_callback(self, callback: Any) -> bool:
        if self.ended:
            return False
        self._callbacks.append(callback)
        return True

    def time_remaining(self) -> float | None:
        return None  # HTTP carries no deadline

    def is_active(self) -> bool:
        if not self.ended and peer_closed(self._sock):
            self.end()
        return not self.ended

    def end(self) -> None:
        """The call is over (client gone, or answered): wake the service's stream."""
        if not self.ended:
            self.ended = True
            for callback in self._callbacks:
                callback()


class OpenAIServer:
    """The HTTP API of one `Runtime` (model_runtime.serving.service), on a thread of its own."""

    def __init__(
        self,
        runtime: Any,
        port: int = 0,
        host: str = "127.0.0.1",
        *,
        max_connections: int = 256,
        max_connections_per_peer: int | None = None,
        request_timeout: float = REQUEST_TIMEOUT_S,
        limits: Limits | None = None,
    ) -> None:
        """`max_connections_per_peer`: half of `max_connections` unless set, so one client
        address cannot hold every connection (the sidecar, the one peer behind the mesh, still
        gets that half)."""
        self.runtime = runtime
        self.max_body = (limits or Limits()).max_buffer_bytes
        self.draining = False
        self.created = int(time.time())
        self._inflight = 0
        self._cond = threading.Condition()
        handler = type("Handler", (_Handler,), {"api": self, "max_body": self.max_body})
        self.httpd = BoundedServer(
            (host, port),
            handler,
            max_connections=max_connections,
            max_per_peer=max_connections_per_peer or max(1, max_connections // 2),
            request_timeout=request_timeout,
            busy=_BUSY,
        )
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="openai-http", daemon=True
        )
        self._thread.start()

    def track(self, delta: int) -> None:
        with self._cond:
            self._inflight += delta
            self._cond.notify_all()

    def drain(self) -> None:
        """Accept no new connection and answer new calls 503; calls in flight go on."""
        if not self.draining:
            self.draining = True
            self.httpd.shutdown()
            self.httpd.server_close()

    def stop(self, timeout: float = 5.0) -> None:
        """Drain, then wait up to `timeout` for the calls in flight to end."""
        self.drain()
        with self._cond:
            self._cond.wait_for(lambda: self._inflight == 0, timeout)
        self._thread.join(timeout=1)


class _Handler(BoundedHandler):
    server_version = "meshlm"
    disable_nagle_algorithm = True  # one small write per token
    api: OpenAIServer

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("openai http: " + fmt, *args)

    # --- errors in OpenAI's shape --------------------------------------------------------

    def send_error(self, code: int, message: str | None = None, explain: str | None = None):
        """http.server's own refusals (a malformed request line, an unknown method)."""
        self.close_connection = True
        self._reply_error(ApiError(code, message or self.responses.get(code, ("error",))[0]))

    def _reply_error(self, e: ApiError, headers: dict[str, str] | None = None) -> None:
        self._reply_json(e.status, e.body(), headers)

    def _reply_json(self, status: int, obj: dict, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(obj).encode()
        try:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if self.close_connection:
                self.send_header("connection", "close")
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client went away
            self.close_connection = True

    # --- GET --------------------------------------------------------------------------------

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        service = self.api.runtime.service
        if path == "/v1/models" or path.startswith("/v1/models/"):
            if service is None:
                self._reply_error(_not_ready())
                return
            ids = service.served_names
            if path == "/v1/models":
                self._reply_json(200, api.model_list(ids, self.api.created))
                return
            wanted = unquote(path[len("/v1/models/") :])
            if wanted in ids:
                self._reply_json(200, api.model_card(wanted, self.api.created))
                return
            self._reply_error(_unknown_model(wanted, ids))
            return
        self._reply_error(ApiError(404, f"no route for GET {path}", code="unknown_url"))

    # --- POST -------------------------------------------------------------------------------

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        translate = {"/v1/chat/completions": api.chat_call, "/v1/completions": api.completion_call}
        service = self.api.runtime.service
        # Refusals known from the headers come before the body is read (and close).
        error = self.length_error()
        if error is not None:
            error = ApiError(*error)
        elif path not in translate:
            error = ApiError(404, f"no route for POST {path}", code="unknown_url")
        elif self.api.draining or service is None:
            error = _draining() if self.api.draining else _not_ready()
        if error is not None:
            self.close_connection = True  # the body was not read
            self._reply_error(error)
            return
        try:
            raw = self.read_body()
        except BodyError as e:
            self.close_connection = True
            self._reply_error(ApiError(e.status, e.message))
            return
        try:
            call = translate[path](api.parse_body(raw))
            try:
                request = codec.encode_generate_request(call.request)
            except UnicodeEncodeError as e:  # JSON may escape a lone surrogate; UTF-8 cannot
                raise ApiError(400, f"a string is not valid Unicode: {e.reason}") from None
        except ApiError as e:
            tenant = self.headers.get(TENANT_HEADER, "")
            service.telemetry.record("Generate", "INVALID_ARGUMENT", tenant=tenant)
            self._reply_error(e)
            return
        self.api.track(1)
        try:
            self._generate(service, call, request)
        finally:
            self.api.track(-1)

    def _generate(self, service: Any, call: api.Call, request: bytes) -> None:
        metadata = [(k.lower(), v) for k, v in self.headers.items()]
        ctx = _HttpCall(metadata, self.connection)
        fingerprint = service.model_info.version
        out = _Output(self, call, fingerprint, ctx)
        try:
            for chunk in _chunks(service.generate(request, ctx)):
                out.add(chunk)
            out.finish()
        except _Aborted as a:
            out.fail(call.error_from_status(a.status, a.message))
        except Exception:  # a fault of this module: answer 500, keep the reason in the log
            log.exception("OpenAI HTTP call failed")
            out.fail(ApiError(500, "internal error in the runtime", type_="server_error"))
        finally:
            ctx.end()


def _chunks(stream: Iterator[bytes]) -> Iterator[codec.TokenChunk]:
    for buf in stream:
        yield codec.decode_token_chunk(buf)


class _Output:
    """The answer of one call: SSE events as tokens come (stream), or one JSON at the end."""

    def __init__(self, h: _Handler, call: api.Call, fingerprint: str, ctx: _HttpCall) -> None:
        self.h, self.call, self.fingerprint, self.ctx = h, call, fingerprint, ctx
        self.text: list[str] = []
        self.tokens = 0
        self.reason: str | None = None
        self.started = False  # response headers sent

    def _prompt_tokens(self) -> int:
        return int(self.ctx.response_headers.get(PROMPT_TOKENS_HEADER, 0))

    def add(self, chunk: codec.TokenChunk) -> None:
        self.tokens += len(chunk.token_ids)
        self.reason = chunk.finish_reason or self.reason
        if self.ctx.ended:
            return  # the client is gone: the service's stream ends at its next event
        if not self.call.stream:
            self.text.append(chunk.text_delta)
            if peer_closed(self.h.connection):
                self.ctx.end()
            return
        if not self.started:
            self._start_stream()
            self._event(api.chunk(self.call, self.fingerprint, chunk.text_delta, None, first=True))
        elif chunk.text_delta:
            self._event(api.chunk(self.call, self.fingerprint, chunk.text_delta, None))

    def _start_stream(self) -> None:
        self.started = True
        h = self.h
        h.send_response(200)
        h.send_header("content-type", "text/event-stream")
        h.send_header("cache-control", "no-cache")
        h.send_header("transfer-encoding", "chunked")
        for k, v in self.ctx.response_headers.items():
            h.send_header(k, v)
        try:
            h.end_headers()
        except OSError:  # the client went away
            h.close_connection = True
            self.ctx.end()

    def _write(self, data: bytes) -> None:
        if self.ctx.ended:
            return
        try:
            self.h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        except OSError:  # the client went away (reset, broken pipe, write timeout)
            self.h.close_connection = True
            self.ctx.end()

    def _event(self, obj: dict | str) -> None:
        self._write(api.sse(obj))

    def finish(self) -> None:
        if self.reason is None:  # the stream ended without an answer: the client left
            self.h.close_connection = True
            return
        prompt = self._prompt_tokens()
        if not self.call.stream:
            body = api.completion(
                self.call, self.fingerprint, "".join(self.text), self.reason, prompt, self.tokens
            )
            self.h._reply_json(200, body, self.ctx.response_headers)
            return
        self._event(api.chunk(self.call, self.fingerprint, None, self.reason))
        if self.call.include_usage:
            self._event(api.usage_chunk(self.call, self.fingerprint, prompt, self.tokens))
        self._event("[DONE]")
        self._write(b"")  # the last chunk of a chunked body

    def fail(self, e: ApiError) -> None:
        if self.ctx.ended and not self.started:
            self.h.close_connection = True
            return
        if not self.started:
            self.h._reply_error(e, self.ctx.response_headers)
            return
        # Mid-stream: an error event, as OpenAI's streams carry one (the SDK raises APIError).
        self._event(e.body())
        self._write(b"")
        self.h.close_connection = True


def _not_ready() -> ApiError:
    return ApiError(
        503, "the model is still loading", type_="server_error", code="service_unavailable"
    )


def _draining() -> ApiError:
    return ApiError(
        503, "the runtime is shutting down", type_="server_error", code="service_unavailable"
    )


def _unknown_model(wanted: str, ids: list[str]) -> ApiError:
    return ApiError(
        404,
        f"model: {wanted[:200]!r} is not served here (this runtime serves {ids[0]!r})",
        param="model",
        code="model_not_found",
    )

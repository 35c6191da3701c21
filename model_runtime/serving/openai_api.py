"""The OpenAI API's JSON, translated: request bodies -> `codec.GenerateRequest`, token chunks ->
response objects and server-sent events, gRPC statuses -> OpenAI-shaped errors.

No sockets here (openai_http.py serves it). The checks of values (ranges, sizes,
roles) stay the codec's and the engine's, the same as for a gRPC call; this module checks only
JSON types and the OpenAI features the runtime does not have, and names fields as OpenAI does
(`max_tokens` for the wire's `max_new_tokens`).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from schemas import codec

CHAT_MAX_TOKENS = 512  # default when a chat call names none (the engine reserves KV for it)
COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
_UINT64 = 1 << 64
# Accepted and ignored: they change nothing a single runtime does.
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# Our extensions (as vLLM's): `top_k`, and `priority`, which can only lower the verified one.
_COMMON = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "n",
    "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_k",
    "priority",
}  # fmt: skip
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format",
                   "tools", "tool_choice", "functions", "function_call"}  # fmt: skip
_COMPLETION = _COMMON | {"prompt", "echo", "best_of", "suffix"}
# gRPC status -> HTTP status, OpenAI error type, code
_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", None),
    "NOT_FOUND": (404, "invalid_request_error", "model_not_found"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "rate_limit_exceeded"),
    "UNAVAILABLE": (503, "server_error", "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "server_error", "timeout"),
}
_FIELD = re.compile(r"^([a-z_]+(?:\[\d+\])?(?:\.[a-z_]+)?): ")


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code = type_, code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


@dataclass
class Call:
    """One API call: what to ask the runtime, and how to shape the answer."""

    kind: str  # "chat" | "completion"
    model: str
    request: codec.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    id: str = ""
    created: int = 0
    names: dict[str, str] = field(default_factory=dict)  # wire field -> the body's name

    def error_from_status(self, status: str, message: str) -> ApiError:
        """The OpenAI error for a gRPC status the service answered (its message names the wire
        field at fault first, as `max_new_tokens: ...`)."""
        http, type_, code = _STATUS.get(status, (500, "server_error", None))
        param = None
        m = _FIELD.match(message) if http in (400, 404) else None
        if m:
            wire = m.group(1)
            base = re.split(r"[\[.]", wire, maxsplit=1)[0]
            param = self.names.get(base, base) + wire[len(base) :]
            message = param + message[len(wire) :]
        return ApiError(http, message, param=param, type_=type_, code=code)


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def chat_call(body: dict[str, Any]) -> Call:
    _check_keys(body, _CHAT)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty array of messages")
    msgs = [_message(i, m) for i, m in enumerate(messages)]
    for name in ("top_logprobs", "tool_choice", "function_call"):
        _unsupported(body, name, (None,))
    for name in ("tools", "functions"):
        _unsupported(body, name, (None, []))
    _unsupported(body, "logprobs", (None, False))
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("response_format", 'only {"type": "text"} is supported')
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    req = codec.GenerateRequest(messages=msgs)
    call = _call("chat", body, req, CHAT_MAX_TOKENS, max_name or "max_tokens")
    call.names |= {"prompt": "messages", "prompt_ids": "messages"}
    return call


def completion_call(body: dict[str, Any]) -> Call:
    _check_keys(body, _COMPLETION)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    req = codec.GenerateRequest()
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        if not all(0 <= t < 1 << 31 for t in prompt):  # the wire's int32; the codec: vocab
            raise bad("prompt", "token ids must be in [0, 2^31)")
        req.prompt_token_ids = prompt
    elif isinstance(prompt, list):
        raise bad("prompt", "a batch of several prompts is not supported: send one per call")
    else:
        raise bad("prompt", "must be a string or an array of token ids")
    _unsupported(body, "echo", (None, False))
    _unsupported(body, "best_of", (None, 1))
    _unsupported(body, "suffix", (None,))
    _unsupported(body, "logprobs", (None,))
    call = _call("completion", body, req, COMPLETION_MAX_TOKENS, "max_tokens")
    call.names |= {"prompt_token_ids": "prompt", "prompt_ids": "prompt"}
    return call


def _call(kind: str, body: dict, req: codec.GenerateRequest, max_default: int, max_name: str):
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "is required: one of the ids GET /v1/models lists")
    stream = _typed(body, "stream", bool, False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options", "is only allowed when stream is true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("stream_options", 'must be {"include_usage": true|false}')
        include_usage = _typed(options, "include_usage", bool, False)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad("n", f"{n!r}: only n=1 is supported (one choice per call)")
    for name in ("presence_penalty", "frequency_penalty"):
        _unsupported(body, name, (None, 0))
    _unsupported(body, "logit_bias", (None, {}))
    req.model = model
    req.max_new_tokens = _int(body, max_name, max_default, low=0)
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= 2:
        raise bad("temperature", f"{temperature} is outside [0, 2]")
    # Below the codec's floor logits / T overflow; the limit of sampling as T -> 0 is greedy.
    req.temperature = 0.0 if temperature < codec.MIN_TEMPERATURE else temperature
    req.top_p = _number(body, "top_p", 1.0)
    if not 0 <= req.top_p <= 1:  # NaN too; the codec refuses 0 and packs a float32
        raise bad("top_p", f"{req.top_p} is outside (0, 1]")
    req.top_k = _int(body, "top_k", 0, low=0)
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or not -(1 << 63) <= seed < _UINT64:
            raise bad("seed", "must be an integer in [-2^63, 2^64)")
        req.seed = seed % _UINT64  # OpenAI's seeds are signed 64-bit; the wire's unsigned
    req.priority = None if body.get("priority") is None else _int(body, "priority", 0)
    stop = body.get("stop")
    if isinstance(stop, str):
        req.stop = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        req.stop = list(stop)
    elif stop is not None:
        raise bad("stop", "must be a string or an array of strings")
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    call = Call(kind, model, req, stream, include_usage, f"{prefix}-{uuid.uuid4().hex}")
    call.created = int(time.time())
    req.request_id = call.id
    call.names["max_new_tokens"] = max_name
    return call


def _check_keys(body: dict, known: set[str]) -> None:
    for key in body:
        if key not in known and key not in _IGNORED:
            raise ApiError(
                400, f"{key}: unrecognized request argument supplied", param=str(key)[:64]
            )


def _unsupported(body: dict, name: str, defaults: tuple) -> None:
    value = body.get(name)
    if not any(value == d and type(value) is type(d) for d in defaults):
        raise bad(name, "is not supported by this runtime (leave it out)")


def _message(i: int, m: Any) -> codec.ChatMessage:
    if not isinstance(m, dict):
        raise bad(f"messages[{i}]", "must be an object with role and content")
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str):
        raise bad(f"messages[{i}].role", "must be a string")
    if role == "developer":  # OpenAI's newer name for the system turn
        role = "system"
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"messages[{i}].content[{j}]", "only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content[{j}].text", "must be a string")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad(f"messages[{i}].content", "must be a string or an array of text parts")
    return codec.ChatMessage(role, content)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _typed(body: dict, name: str, kind: type, default: Any) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, kind):
        raise bad(name, f"must be a {kind.__name__}")
    return v


def _int(body: dict, name: str, default: int, low: int = -(1 << 31)) -> int:
    """An integer in [low, 2^31): the wire's int32, or its uint32 with `low` 0 (the codec
    checks the field's own range after)."""
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(name, f"{repr(v)[:64]} is not an integer")
    if not low <= v < 1 << 31:
        raise bad(name, f"{v} is outside [{low}, 2^31)")
    return v


def _number(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"{v!r} is not a number")
    return float(v)


# --- responses ------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _head(call: Call, fingerprint: str, chunk: bool) -> dict[str, Any]:
    obj = "chat.completion" if call.kind == "chat" else "text_completion"
    return {
        "id": call.id,
        "object": f"{obj}.chunk" if chunk and call.kind == "chat" else obj,
        "created": call.created,
        "model": call.model,
        "system_fingerprint": fingerprint,
    }


def completion(
    call: Call, fingerprint: str, text: str, finish: str, prompt_tokens: int, tokens: int
) -> dict[str, Any]:
    """The whole answer of a call without `stream`."""
    if call.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text}
    choice |= {"logprobs": None, "finish_reason": finish}
    return _head(call, fingerprint, False) | {
        "choices": [choice],
        "usage": usage(prompt_tokens, tokens),
    }


def chunk(
    call: Call, fingerprint: str, text: str | None, finish: str | None, *, first: bool = False
) -> dict[str, Any]:
    """One streamed event's object: a text delta (`first`: the chat role with it), or the last
    with a finish reason."""
    if call.kind == "chat":
        delta: dict[str, str] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": text or ""}
    choice |= {"logprobs": None, "finish_reason": finish}
    out = _head(call, fingerprint, True) | {"choices": [choice]}
    if call.include_usage:
        out["usage"] = None  # as OpenAI: null on every chunk but the last
    return out


def usage_chunk(call: Call, fingerprint: str, prompt_tokens: int, tokens: int) -> dict:
    """With stream_options.include_usage: the last event, no choices, the call's usage."""
    return _head(call, fingerprint, True) | {
        "choices": [],
        "usage": usage(prompt_tokens, tokens),
    }


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def model_list(ids: list[str], created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(i, created) for i in ids]}


def model_card(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "meshlm"}

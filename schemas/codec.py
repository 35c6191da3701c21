"""Encode and decode the inference messages, with validation.

Every `decode_*` first runs the verifier (`schemas.verify`) and then checks values and limits (a
token chunk in the server's fixed layout is checked against that exact layout instead, which
accepts only buffers the verifier accepts, read the same way); anything wrong raises
`WireError(field, message)` — never another exception (a MemoryError or a RecursionError becomes
a WireError too), never a silent out-of-bounds read. Encoders reuse one
flatbuffers.Builder per thread. Token arrays come back as zero-copy numpy int32 views of the
received buffer.
"""

from __future__ import annotations

import functools
import math
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import flatbuffers
import numpy as np

from schemas.meshlm import inference_generated as fb
from schemas.verify import Field, Table, WireError, verify

__all__ = [
    "ChatMessage",
    "ErrorInfo",
    "GenerateRequest",
    "Limits",
    "ModelInfo",
    "TokenChunk",
    "WireError",
    "decode_generate_request",
    "decode_info_request",
    "decode_model_info",
    "decode_token_chunk",
    "decode_token_chunk_fixed",
    "decode_token_chunk_verified",
    "encode_generate_request",
    "encode_info_request",
    "encode_model_info",
    "encode_token_chunk",
]

# The verifier's view of inference.fbs: fields in slot order (tests compare it with the .fbs).
CHAT_MESSAGE = Table(
    "ChatMessage",
    (Field("role", "string", required=True), Field("content", "string", required=True)),
)
GENERATE_REQUEST = Table(
    "GenerateRequest",
    (
        Field("request_id", "string"),
        Field("model", "string"),
        Field("prompt", "string"),
        Field("prompt_token_ids", "vector", 4),
        Field("messages", "tables", table=CHAT_MESSAGE),
        Field("max_new_tokens", "scalar", 4),
        Field("temperature", "scalar", 4),
        Field("top_p", "scalar", 4),
        Field("top_k", "scalar", 4),
        Field("seed", "scalar", 8),
        Field("stop", "strings"),
        Field("priority", "scalar", 4),
        Field("resume_token_ids", "vector", 4),
        Field("resume_index", "scalar", 4),
        Field("avoid_replica", "string"),
    ),
)
ERROR = Table(
    "Error", (Field("code", "scalar", 4), Field("message", "string"), Field("field", "string"))
)
TOKEN_CHUNK = Table(
    "TokenChunk",
    (
        Field("request_id", "string"),
        Field("index", "scalar", 4),
        Field("token_ids", "vector", 4),
        Field("text_delta", "string"),
        Field("finish_reason", "scalar", 1),
        Field("queue_wait_us", "scalar", 8),
        Field("ttft_us", "scalar", 8),
        Field("error", "table", table=ERROR),
    ),
)
INFO_REQUEST = Table("InfoRequest", ())
MODEL_INFO = Table(
    "ModelInfo",
    (
        Field("name", "string"),
        Field("precision", "string"),
        Field("version", "string"),
        Field("context_length", "scalar", 4),
        Field("vocab_size", "scalar", 4),
        Field("compute_dtype", "string"),
        Field("compute", "string"),
        Field("kernels", "string"),
    ),
)

FINISH_REASONS: tuple[str | None, ...] = (None, "stop", "length", "cancelled", "error")
_FINISH_CODE = {name: code for code, name in enumerate(FINISH_REASONS)}
ROLES = frozenset({"system", "user", "assistant", "tool"})
MIN_TEMPERATURE = 1e-3


@dataclass(frozen=True)
class Limits:
    """What a server accepts. context_length / vocab_size are filled in from the loaded model."""

    max_buffer_bytes: int = 4 << 20
    max_prompt_bytes: int = 256 << 10
    max_prompt_tokens: int = 1 << 16
    max_messages: int = 256
    max_stop: int = 16
    max_stop_bytes: int = 256
    max_id_bytes: int = 256
    context_length: int | None = None
    vocab_size: int | None = None


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass
class GenerateRequest:
    request_id: str = ""
    model: str = ""
    prompt: str | None = None
    prompt_token_ids: Any = None  # sequence of int, or a numpy int32 array once decoded
    messages: list[ChatMessage] | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    priority: int | None = None
    resume_token_ids: Any = None  # ids the caller already got (a resume); numpy once decoded
    resume_index: int = 0  # the index of the resumed stream's first chunk
    avoid_replica: str = ""  # a replica id that must not serve this call


@dataclass(frozen=True)
class ErrorInfo:
    code: int
    message: str
    field: str = ""


@dataclass
class TokenChunk:
    request_id: str
    index: int
    token_ids: Any  # numpy int32 array (decoded) or a list of int
    text_delta: str
    finish_reason: str | None = None
    queue_wait_us: int = 0
    ttft_us: int | None = None
    error: ErrorInfo | None = None


@dataclass(frozen=True)
class ModelInfo:
    name: str
    precision: str
    version: str
    context_length: int
    vocab_size: int = 0
    # what the runtime computes in, chosen at load; "" = unknown (a server older than the fields)
    compute_dtype: str = ""  # "bf16" | "fp32" | "fp16"
    compute: str = ""  # one line, e.g. "int4 weights on native kernels, bf16 activations"
    kernels: str = ""  # what runs the linear layers: "native" | "torch" | "native+torch"


_tls = threading.local()


def _builder() -> flatbuffers.Builder:
    b = getattr(_tls, "builder", None)
    if b is None:
        b = _tls.builder = flatbuffers.Builder(1024)
    else:
        b.Clear()
    return b


def _finish(b: flatbuffers.Builder, root: int) -> bytes:
    b.Finish(root)
    return bytes(memoryview(b.Bytes)[b.Head() :])


def _str(b: flatbuffers.Builder, s: str | None) -> int:
    return b.CreateString(s) if s else 0


def _int32_vector(b: flatbuffers.Builder, values: Any) -> int:
    return b.CreateNumpyVector(np.asarray(values, dtype="<i4").ravel())


def _text(raw: bytes | None) -> str:
    # The verifier already proved UTF-8; generated accessors hand back bytes.
    return raw.decode("utf-8") if raw else ""


# --- GenerateRequest -------------------------------------------------------------------------


def encode_generate_request(req: GenerateRequest) -> bytes:
    b = _builder()
    rid, model, prompt = _str(b, req.request_id), _str(b, req.model), _str(b, req.prompt)
    ids = _int32_vector(b, req.prompt_token_ids) if req.prompt_token_ids is not None else 0
    resume = _int32_vector(b, req.resume_token_ids) if req.resume_token_ids is not None else 0
    avoid = _str(b, req.avoid_replica)
    msgs = 0
    if req.messages is not None:
        offs = []
        for m in req.messages:
            role, content = b.CreateString(m.role), b.CreateString(m.content)
            fb.ChatMessageStart(b)
            fb.ChatMessageAddRole(b, role)
            fb.ChatMessageAddContent(b, content)
            offs.append(fb.ChatMessageEnd(b))
        msgs = _offset_vector(b, offs)
    stop = _offset_vector(b, [b.CreateString(s) for s in req.stop]) if req.stop else 0
    fb.GenerateRequestStart(b)
    for slot_add, value in (
        (fb.GenerateRequestAddRequestId, rid),
        (fb.GenerateRequestAddModel, model),
        (fb.GenerateRequestAddPrompt, prompt),
        (fb.GenerateRequestAddPromptTokenIds, ids),
        (fb.GenerateRequestAddMessages, msgs),
        (fb.GenerateRequestAddStop, stop),
        (fb.GenerateRequestAddResumeTokenIds, resume),
        (fb.GenerateRequestAddAvoidReplica, avoid),
    ):
        if value:
            slot_add(b, value)
    fb.GenerateRequestAddMaxNewTokens(b, req.max_new_tokens)
    fb.GenerateRequestAddTemperature(b, req.temperature)
    fb.GenerateRequestAddTopP(b, req.top_p)
    fb.GenerateRequestAddTopK(b, req.top_k)
    if req.seed is not None:
        fb.GenerateRequestAddSeed(b, req.seed)
    if req.priority is not None:
        fb.GenerateRequestAddPriority(b, req.priority)
    if req.resume_index:
        fb.GenerateRequestAddResumeIndex(b, req.resume_index)
    return _finish(b, fb.GenerateRequestEnd(b))


def _offset_vector(b: flatbuffers.Builder, offsets: list[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return b.EndVector()


_R = TypeVar("_R")


def _wire_errors_only(message: str) -> Callable[[Callable[..., _R]], Callable[..., _R]]:
    """Make any exception other than WireError escaping a decoder a WireError on `message`."""

    def wrap(decode: Callable[..., _R]) -> Callable[..., _R]:
        @functools.wraps(decode)
        def decode_or_wire_error(*args: Any, **kwargs: Any) -> _R:
            try:
                return decode(*args, **kwargs)
            except WireError:
                raise
            except Exception as e:  # MemoryError, RecursionError, a bug: the caller's contract
                # is WireError (gRPC INVALID_ARGUMENT), never a crash or an INTERNAL.
                raise WireError(message, f"cannot be decoded ({type(e).__name__})") from None

        return decode_or_wire_error

    return wrap


@_wire_errors_only("GenerateRequest")
def decode_generate_request(buf: bytes, limits: Limits = DEFAULT_LIMITS) -> GenerateRequest:
    """Verify and validate a GenerateRequest; raise WireError naming the field at fault."""
    # Counts first: each stop string or message is read (and copied) once per offset to it.
    counts = {
        "stop": limits.max_stop,
        "messages": limits.max_messages,
        "resume_token_ids": _max_tokens(limits),
    }
    verify(buf, GENERATE_REQUEST, limits.max_buffer_bytes, counts)
    t = fb.GenerateRequest.GetRootAs(buf, 0)
    req = GenerateRequest(
        request_id=_text(t.RequestId()),
        model=_text(t.Model()),
        prompt=None if t.Prompt() is None else _text(t.Prompt()),
        prompt_token_ids=None if t.PromptTokenIdsIsNone() else _ids(t.PromptTokenIdsAsNumpy()),
        messages=None
        if t.MessagesIsNone()
        else [
            ChatMessage(_text(m.Role()), _text(m.Content()))
            for m in (t.Messages(i) for i in range(t.MessagesLength()))
        ],
        max_new_tokens=t.MaxNewTokens(),
        temperature=t.Temperature(),
        top_p=t.TopP(),
        top_k=t.TopK(),
        seed=t.Seed(),
        stop=[_text(t.Stop(i)) for i in range(t.StopLength())],
        priority=t.Priority(),
        resume_token_ids=None if t.ResumeTokenIdsIsNone() else _ids(t.ResumeTokenIdsAsNumpy()),
        resume_index=t.ResumeIndex(),
        avoid_replica=_text(t.AvoidReplica()),
    )
    validate_generate_request(req, limits)
    return req


def _ids(a: Any) -> np.ndarray:
    # GetVectorAsNumpy returns 0 for an empty vector's absent data on some paths; normalise.
    return a if isinstance(a, np.ndarray) else np.zeros(0, dtype="<i4")


def _max_tokens(limits: Limits) -> int:
    return min(limits.max_prompt_tokens, limits.context_length or 1 << 30)


def _check_vocab(name: str, ids: np.ndarray, limits: Limits) -> None:
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (limits.vocab_size is not None and hi >= limits.vocab_size):
        bad = lo if lo < 0 else hi
        raise WireError(name, f"token id {bad} is outside [0, {limits.vocab_size or '2^31'})")


def validate_generate_request(req: GenerateRequest, limits: Limits = DEFAULT_LIMITS) -> None:
    """Value checks shared by the decoder and by callers that build requests in Python."""
    for name in ("request_id", "model", "avoid_replica"):
        if len(getattr(req, name).encode()) > limits.max_id_bytes:
            raise WireError(name, f"longer than {limits.max_id_bytes} bytes")
    given = [
        name
        for name in ("prompt", "prompt_token_ids", "messages")
        if getattr(req, name) is not None
    ]
    if len(given) != 1:
        raise WireError(
            "prompt",
            "exactly one of prompt, prompt_token_ids, messages must be set"
            + (f" (got {', '.join(given)})" if given else ""),
        )
    if req.prompt is not None:
        if not req.prompt:
            raise WireError("prompt", "is empty")
        if len(req.prompt.encode()) > limits.max_prompt_bytes:
            raise WireError("prompt", f"longer than {limits.max_prompt_bytes} bytes")
    if req.prompt_token_ids is not None:
        ids = np.asarray(req.prompt_token_ids)
        max_tokens = _max_tokens(limits)
        if ids.size == 0:
            raise WireError("prompt_token_ids", "is empty")
        if ids.size > max_tokens:
            raise WireError("prompt_token_ids", f"{ids.size} tokens exceed the limit {max_tokens}")
        _check_vocab("prompt_token_ids", ids, limits)
    if req.messages is not None:
        if not req.messages:
            raise WireError("messages", "is empty")
        if len(req.messages) > limits.max_messages:
            raise WireError("messages", f"more than {limits.max_messages} messages")
        total = 0
        for i, m in enumerate(req.messages):
            if m.role not in ROLES:
                roles = ", ".join(sorted(ROLES))
                raise WireError(f"messages[{i}].role", f"{m.role[:32]!r} is not one of {roles}")
            total += len(m.content.encode())
        if total > limits.max_prompt_bytes:
            raise WireError("messages", f"contents longer than {limits.max_prompt_bytes} bytes")
    max_new = limits.context_length or 1 << 16
    if not 1 <= req.max_new_tokens <= max_new:
        raise WireError("max_new_tokens", f"{req.max_new_tokens} is outside [1, {max_new}]")
    # 0 means greedy; a tiny positive temperature overflows logits / T into inf and NaN.
    t = req.temperature
    if not (math.isfinite(t) and (t == 0.0 or MIN_TEMPERATURE <= t <= 100.0)):
        raise WireError("temperature", f"{t} must be 0 (greedy) or in [{MIN_TEMPERATURE}, 100]")
    if not (math.isfinite(req.top_p) and 0.0 < req.top_p <= 1.0):
        raise WireError("top_p", f"{req.top_p} is outside (0, 1]")
    max_k = limits.vocab_size or 1 << 20
    if not 0 <= req.top_k <= max_k:
        raise WireError("top_k", f"{req.top_k} is outside [0, {max_k}]")
    if len(req.stop) > limits.max_stop:
        raise WireError("stop", f"more than {limits.max_stop} stop sequences")
    for i, s in enumerate(req.stop):
        if not s or len(s.encode()) > limits.max_stop_bytes:
            raise WireError(f"stop[{i}]", f"must be 1..{limits.max_stop_bytes} bytes")
    if req.priority is not None and not -1000 <= req.priority <= 1000:
        raise WireError("priority", f"{req.priority} is outside [-1000, 1000]")
    if req.seed is not None and not 0 <= req.seed < 1 << 64:  # a uint64 on the wire
        raise WireError("seed", f"{req.seed} is outside [0, 2^64)")
    if not 0 <= req.resume_index < 1 << 32:  # a uint32 on the wire
        raise WireError("resume_index", f"{req.resume_index} is outside [0, 2^32)")
    if req.resume_token_ids is not None:
        _validate_resume(req, np.asarray(req.resume_token_ids), limits)


def _validate_resume(req: GenerateRequest, ids: np.ndarray, limits: Limits) -> None:
    """Resume ids: counted against max_new_tokens, and with the prompt they must
    leave room in the context for one more token (a text prompt's length is checked by the
    runtime once it is tokenized)."""
    if ids.size == 0:
        return
    if ids.size > req.max_new_tokens:
        raise WireError(
            "resume_token_ids",
            f"{ids.size} ids already delivered exceed max_new_tokens {req.max_new_tokens}",
        )
    context = limits.context_length or 1 << 30
    prompt = 0 if req.prompt_token_ids is None else len(req.prompt_token_ids)
    if max(prompt, 1) + ids.size >= context:
        raise WireError(
            "resume_token_ids",
            f"{ids.size} ids after a prompt of {prompt or 'at least 1'} tokens leave no room "
            f"in the context of {context}",
        )
    _check_vocab("resume_token_ids", ids, limits)


# --- TokenChunk (one per streamed event: keep it cheap) --------------------------------------


# A fixed layout for the common case (no error table), written with one struct.pack instead of
# ~30 Builder calls: root offset, vtable (8 slots), then the table at byte 28 so its uint64 fields
# are 8-aligned, then token_ids, text_delta and request_id. The verifier accepts it like any other
# FlatBuffer; tests decode it with the flatc-generated reader. Clients recognise it by its first
# 32 bytes and read it without the general verifier (`decode_token_chunk_fixed`).
_CHUNK_TABLE = 28
_CHUNK_DATA = 72  # the token_ids vector; text_delta and request_id follow it


def _chunk_head(ttft: bool) -> bytes:
    """Bytes 0-31: root offset, vtable (size, table size, slot offsets), the table's soffset."""
    # Field offsets in slot order: request_id, index, token_ids, text_delta, finish_reason,
    # queue_wait_us, ttft_us (absent = null), error (absent).
    slots = (20, 24, 28, 32, 40, 4, 12 if ttft else 0, 0)
    return struct.pack("<I10H4xi", _CHUNK_TABLE, 20, 44, *slots, _CHUNK_TABLE - 4)


_CHUNK_HEADS = {True: _chunk_head(True), False: _chunk_head(False)}
_CHUNK_HEAD_TUPLE = (_CHUNK_HEADS[True], _CHUNK_HEADS[False])
# Bytes 32-75: queue_wait_us, ttft_us, then the uoffsets and scalars in slot-offset order
# (request_id, index, token_ids, text_delta, 4 unused bytes, finish_reason) and the token count.
_CHUNK_BODY = struct.Struct("<QQIIII4xb3xI")
_RID_REF, _IDS_REF, _TEXT_REF = _CHUNK_TABLE + 20, _CHUNK_TABLE + 28, _CHUNK_TABLE + 32
_U32 = struct.Struct("<I").unpack_from
_CHUNK_MIN = _CHUNK_DATA + 4 + 8 + 5  # no tokens, empty text_delta and request_id
_MAX_FIXED = DEFAULT_LIMITS.max_buffer_bytes  # decode_token_chunk_verified refuses bigger ones
_INT32S = [struct.Struct(f"<{n}i") for n in range(64)]  # token_ids of a chunk, by length


def encode_token_chunk(
    request_id: str,
    index: int,
    token_ids: Any,
    text_delta: str,
    finish_reason: str | None = None,
    queue_wait_us: int = 0,
    ttft_us: int | None = None,
    error: ErrorInfo | None = None,
) -> bytes:
    if error is not None:
        return encode_token_chunk_builder(
            request_id, index, token_ids, text_delta, finish_reason, queue_wait_us, ttft_us, error
        )
    n = len(token_ids)
    text = text_delta.encode("utf-8")
    rid = request_id.encode("utf-8")
    text_pos = _CHUNK_DATA + 4 + 4 * n
    rid_pos = text_pos + 4 + ((len(text) + 4) & ~3)
    ids = _INT32S[n] if n < 64 else struct.Struct(f"<{n}i")
    return b"".join(
        (
            _CHUNK_HEADS[ttft_us is not None],
            _CHUNK_BODY.pack(
                queue_wait_us,
                ttft_us or 0,
                rid_pos - _RID_REF,
                index,
                _CHUNK_DATA - _IDS_REF,
                text_pos - _TEXT_REF,
                _FINISH_CODE[finish_reason],
                n,
            ),
            ids.pack(*token_ids),
            _string_bytes(text),
            len(rid).to_bytes(4, "little"),
            rid,
            b"\0",  # the last string needs no padding: truncating any byte breaks the buffer
        )
    )


def decode_token_chunk_fixed(buf: bytes | bytearray | memoryview) -> TokenChunk | None:
    """Read a chunk in exactly the fixed layout `encode_token_chunk` writes, or return None.

    Only the positions that layout allows are accepted: the 32-byte head, the token vector at
    byte 72, text_delta right after it, request_id right after that and ending the buffer, both
    strings zero-terminated UTF-8, a known finish_reason. Such a buffer passes `verify()` (every
    region is in bounds, aligned and read once, so no alias and no budget to exceed) and reads
    as the generated reader reads it; anything else, valid or not, is left to the verifier.
    """
    n = len(buf)
    if type(buf) is not bytes or not _CHUNK_MIN <= n <= _MAX_FIXED:
        return None
    if not buf.startswith(_CHUNK_HEAD_TUPLE):
        return None
    wait, ttft, rid_off, index, ids_off, text_off, code, count = _CHUNK_BODY.unpack_from(buf, 32)
    text_pos = _CHUNK_DATA + 4 + 4 * count
    if ids_off != _CHUNK_DATA - _IDS_REF or text_off != text_pos - _TEXT_REF or text_pos + 4 > n:
        return None
    text_end = text_pos + 4 + _U32(buf, text_pos)[0]
    rid_pos = (text_end + 4) & ~3
    rid_end = rid_pos + 4 + _U32(buf, rid_pos)[0] if rid_pos + 5 <= n else 0
    if rid_off != rid_pos - _RID_REF or rid_end != n - 1 or buf[rid_end] or buf[text_end]:
        return None
    if not 0 <= code < len(FINISH_REASONS):
        return None
    try:
        text = buf[text_pos + 4 : text_end].decode("utf-8")
        rid = buf[rid_pos + 4 : rid_end].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return TokenChunk(
        rid,
        index,
        np.frombuffer(buf, "<i4", count, _CHUNK_DATA + 4),
        text,
        FINISH_REASONS[code],
        wait,
        ttft if buf[20] else None,  # the ttft_us slot of the vtable
    )


def _string_bytes(raw: bytes) -> bytes:
    return len(raw).to_bytes(4, "little") + raw + b"\0" * (4 - (len(raw) & 3))


def encode_token_chunk_builder(
    request_id: str,
    index: int,
    token_ids: Any,
    text_delta: str,
    finish_reason: str | None = None,
    queue_wait_us: int = 0,
    ttft_us: int | None = None,
    error: ErrorInfo | None = None,
) -> bytes:
    """The same message through flatbuffers.Builder (used when an Error table is attached)."""
    b = _builder()
    err = 0
    if error is not None:
        msg, fld = _str(b, error.message), _str(b, error.field)
        fb.ErrorStart(b)
        fb.ErrorAddCode(b, error.code)
        if msg:
            fb.ErrorAddMessage(b, msg)
        if fld:
            fb.ErrorAddField(b, fld)
        err = fb.ErrorEnd(b)
    text = _str(b, text_delta)
    rid = _str(b, request_id)
    b.StartVector(4, len(token_ids), 4)
    for t in reversed(token_ids):
        b.PrependInt32(t)
    ids = b.EndVector()
    fb.TokenChunkStart(b)
    if rid:
        fb.TokenChunkAddRequestId(b, rid)
    fb.TokenChunkAddIndex(b, index)
    fb.TokenChunkAddTokenIds(b, ids)
    if text:
        fb.TokenChunkAddTextDelta(b, text)
    fb.TokenChunkAddFinishReason(b, _FINISH_CODE[finish_reason])
    fb.TokenChunkAddQueueWaitUs(b, queue_wait_us)
    if ttft_us is not None:
        fb.TokenChunkAddTtftUs(b, ttft_us)
    if err:
        fb.TokenChunkAddError(b, err)
    return _finish(b, fb.TokenChunkEnd(b))


@_wire_errors_only("TokenChunk")
def decode_token_chunk(buf: bytes, max_size: int = DEFAULT_LIMITS.max_buffer_bytes) -> TokenChunk:
    """Verify and read a chunk: the server's fixed layout directly, anything else through the
    verifier (either way the same chunk, or the same WireError)."""
    if len(buf) <= max_size:
        chunk = decode_token_chunk_fixed(buf)
        if chunk is not None:
            return chunk
    return decode_token_chunk_verified(buf, max_size)


@_wire_errors_only("TokenChunk")
def decode_token_chunk_verified(
    buf: bytes, max_size: int = DEFAULT_LIMITS.max_buffer_bytes
) -> TokenChunk:
    """Any well-formed TokenChunk, through the verifier and the flatc-generated reader."""
    verify(buf, TOKEN_CHUNK, max_size)
    t = fb.TokenChunk.GetRootAs(buf, 0)
    code = t.FinishReason()
    if not 0 <= code < len(FINISH_REASONS):
        raise WireError("finish_reason", f"unknown value {code}")
    e = t.Error()
    return TokenChunk(
        request_id=_text(t.RequestId()),
        index=t.Index(),
        token_ids=_ids(t.TokenIdsAsNumpy()),
        text_delta=_text(t.TextDelta()),
        finish_reason=FINISH_REASONS[code],
        queue_wait_us=t.QueueWaitUs(),
        ttft_us=t.TtftUs(),
        error=None if e is None else ErrorInfo(e.Code(), _text(e.Message()), _text(e.Field())),
    )


# --- Info ------------------------------------------------------------------------------------


def encode_info_request() -> bytes:
    b = _builder()
    fb.InfoRequestStart(b)
    return _finish(b, fb.InfoRequestEnd(b))


@_wire_errors_only("InfoRequest")
def decode_info_request(buf: bytes) -> None:
    verify(buf, INFO_REQUEST, 1 << 16)


def encode_model_info(info: ModelInfo) -> bytes:
    b = _builder()
    name, precision, version = _str(b, info.name), _str(b, info.precision), _str(b, info.version)
    dtype, compute = _str(b, info.compute_dtype), _str(b, info.compute)
    kernels = _str(b, info.kernels)
    fb.ModelInfoStart(b)
    if name:
        fb.ModelInfoAddName(b, name)
    if precision:
        fb.ModelInfoAddPrecision(b, precision)
    if version:
        fb.ModelInfoAddVersion(b, version)
    fb.ModelInfoAddContextLength(b, info.context_length)
    fb.ModelInfoAddVocabSize(b, info.vocab_size)
    if dtype:
        fb.ModelInfoAddComputeDtype(b, dtype)
    if compute:
        fb.ModelInfoAddCompute(b, compute)
    if kernels:
        fb.ModelInfoAddKernels(b, kernels)
    return _finish(b, fb.ModelInfoEnd(b))


@_wire_errors_only("ModelInfo")
def decode_model_info(buf: bytes) -> ModelInfo:
    verify(buf, MODEL_INFO, 1 << 16)
    t = fb.ModelInfo.GetRootAs(buf, 0)
    return ModelInfo(
        _text(t.Name()),
        _text(t.Precision()),
        _text(t.Version()),
        t.ContextLength(),
        t.VocabSize(),
        compute_dtype=_text(t.ComputeDtype()),
        compute=_text(t.Compute()),
        kernels=_text(t.Kernels()),
    )

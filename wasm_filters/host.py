"""A proxy-wasm (ABI 0.2.1) host on `wasmtime`, enough to run the real filters without Envoy.

It implements the host calls the filter imports, with Envoy's semantics where they matter:
header lookups return the first value and NotFound when absent, replace drops every old value,
shared data has Envoy's compare-and-swap (cas 0 writes unconditionally), a new configuration
gets a new root context (as an ECDS update does) and a refused one leaves the previous root in
charge. A request body arrives in the chunks given: while the filter answers
StopIterationAndBuffer, the body callback sees everything buffered so far, as in Envoy. The
clock is settable so token-bucket refills are tested without sleeping. A request may come from a
peer with a verified certificate: property `connection.uri_san_peer_certificate` is its SPIFFE
ID (Envoy's value on an mTLS connection), absent otherwise. Several hosts may share
one `SharedData`, as Envoy's worker VMs do.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass, field
from pathlib import Path

import wasmtime

WASM_PATH = Path(__file__).resolve().parent / "authz.wasm"
CLASSIFY_WASM_PATH = Path(__file__).resolve().parent / "classify.wasm"

OK, NOT_FOUND, BAD_ARGUMENT, CAS_MISMATCH = 0, 1, 2, 8
REQUEST_HEADERS = 0
REQUEST_BODY = 0  # BufferType::HttpRequestBody
CONTINUE, STOP_ITERATION = 0, 1  # FilterHeadersStatus / FilterDataStatus (StopIterationAndBuffer)
PLUGIN_CONFIGURATION = 7
LOG_LEVELS = ("trace", "debug", "info", "warn", "error", "critical")

_I32 = wasmtime.ValType.i32()
_I64 = wasmtime.ValType.i64()


class SharedData:
    """Envoy's per-vm_id shared data: key -> (value, cas)."""

    def __init__(self) -> None:
        self.items: dict[bytes, tuple[bytes, int]] = {}
        self._cas = itertools.count(1)

    def get(self, key: bytes) -> tuple[bytes, int] | None:
        return self.items.get(key)

    def set(self, key: bytes, value: bytes, cas: int) -> int:
        old = self.items.get(key)
        if old is not None and cas and cas != old[1]:
            return CAS_MISMATCH
        self.items[key] = (value, next(self._cas))
        return OK


@dataclass
class Decision:
    """What the filter did with one request."""

    allowed: bool
    status: int | None = None  # local response HTTP status, None when allowed
    grpc_status: int | None = None
    body: bytes = b""
    details: str = ""
    response_headers: dict[str, str] = field(default_factory=dict)
    request_headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    def header(self, name: str) -> bytes | None:
        n = name.encode()
        return next((v for k, v in self.request_headers if k == n), None)


class WasmHost:
    def __init__(
        self,
        wasm: bytes | Path = WASM_PATH,
        *,
        shared: SharedData | None = None,
        now_ns: int = 1_700_000_000 * 10**9,
    ) -> None:
        self.now_ns = now_ns
        self.shared = shared if shared is not None else SharedData()
        self.logs: list[tuple[str, str]] = []
        self.metric_names: dict[int, str] = {}
        self.metrics: dict[str, int] = {}
        self.root_id: int | None = None  # the root context that serves new streams
        self._ids = itertools.count(1)
        self._config = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body = b""
        self._principal: bytes | None = None
        self._local: Decision | None = None
        raw = wasm.read_bytes() if isinstance(wasm, Path) else wasm
        engine, module = _compiled(raw)
        self.store = wasmtime.Store(engine)
        linker = wasmtime.Linker(engine)
        for name, params, results in _IMPORTS:
            fn = getattr(self, "_" + name)
            ty = wasmtime.FuncType(params, results)
            linker.define_func("env", name, ty, fn, access_caller=True)
        self.instance = linker.instantiate(self.store, module)
        ex = self.instance.exports(self.store)
        self._ex = {n: ex[n] for n in _EXPORTS if n in ex}
        self._ex["proxy_on_vm_start"](self.store, 0, 0)

    # ---- driving the filter ----
    def advance(self, seconds: float) -> None:
        self.now_ns += int(seconds * 1e9)

    def configure(self, config: bytes | str) -> bool:
        """Deliver a configuration to a new root context; on success it serves new streams."""
        self._config = config.encode() if isinstance(config, str) else config
        rid = next(self._ids)
        self._ex["proxy_on_context_create"](self.store, rid, 0)
        ok = bool(self._ex["proxy_on_configure"](self.store, rid, len(self._config)))
        if ok or self.root_id is None:
            old, self.root_id = self.root_id, rid
            if old is not None:
                self._ex["proxy_on_delete"](self.store, old)
        else:
            self._ex["proxy_on_delete"](self.store, rid)
        return ok

    def request(
        self,
        headers: dict[str, str | bytes] | list[tuple[str | bytes, str | bytes]],
        *,
        path: str = "/meshlm.inference.v1.Inference/Generate",
        grpc: bool = True,
        body: bytes | list[bytes] | None = None,
        principal: str | None = None,
    ) -> Decision:
        """Run one request through the filter: its headers, then `body` (one chunk or several;
        None: the headers end the stream). `:path`/content-type are added unless given.
        `principal`: the URI SAN of the peer's verified certificate (None: plaintext).
        Raises wasmtime.Trap if the filter traps (it must not)."""
        items = list(headers.items()) if isinstance(headers, dict) else list(headers)
        hs = [(_b(k).lower(), _b(v)) for k, v in items]
        names = {k for k, _ in hs}
        if b":path" not in names:
            hs.append((b":path", path.encode()))
        if b"content-type" not in names:
            hs.append((b"content-type", b"application/grpc" if grpc else b"application/json"))
        self._headers, self._local = hs, None
        self._principal = None if principal is None else principal.encode()
        ctx = next(self._ids)
        self._ex["proxy_on_context_create"](self.store, ctx, self.root_id or 0)
        chunks = [] if body is None else [body] if isinstance(body, bytes) else list(body)
        eos = int(not chunks)
        action = self._ex["proxy_on_request_headers"](self.store, ctx, len(hs), eos)
        self._body, buffered = b"", action == STOP_ITERATION and self._local is None
        for i, chunk in enumerate(chunks):
            if self._local is not None:
                break
            self._body = self._body + chunk if buffered else chunk
            last = int(i == len(chunks) - 1)
            on_body = self._ex["proxy_on_request_body"]
            data_action = on_body(self.store, ctx, len(self._body), last)
            if buffered and data_action == CONTINUE:
                action, buffered = CONTINUE, False
            elif not buffered and data_action == STOP_ITERATION and action == CONTINUE:
                raise AssertionError("filter buffered a body it had let through")
        if "proxy_on_done" in self._ex:  # optional, as in Envoy
            self._ex["proxy_on_done"](self.store, ctx)
        self._ex["proxy_on_delete"](self.store, ctx)
        if self._local is not None:
            return self._local
        assert action == CONTINUE, "filter kept the request paused at its end, no local response"
        return Decision(allowed=True, request_headers=list(self._headers))

    # ---- memory helpers ----
    @staticmethod
    def _mem(caller: wasmtime.Caller) -> wasmtime.Memory:
        return caller["memory"]  # type: ignore[return-value]

    def _read(self, caller: wasmtime.Caller, ptr: int, size: int) -> bytes:
        return bytes(self._mem(caller).read(caller, ptr, ptr + size)) if size else b""

    def _give(self, caller: wasmtime.Caller, data: bytes, ptr_out: int, size_out: int) -> None:
        """Copy `data` into memory the module allocates, and return pointer and size."""
        alloc = caller["proxy_on_memory_allocate"]
        p = alloc(caller, len(data))  # type: ignore[operator]
        mem = self._mem(caller)
        if data:
            mem.write(caller, data, p)
        mem.write(caller, struct.pack("<I", p), ptr_out)
        mem.write(caller, struct.pack("<I", len(data)), size_out)

    # ---- host calls (names as imported, minus the leading underscore) ----
    def _proxy_log(self, caller: wasmtime.Caller, level: int, ptr: int, size: int) -> int:
        msg = self._read(caller, ptr, size).decode(errors="replace")
        self.logs.append((LOG_LEVELS[level] if 0 <= level < 6 else str(level), msg))
        return OK

    def _proxy_get_buffer_bytes(
        self, caller: wasmtime.Caller, kind: int, start: int, max_size: int, p_out: int, s_out: int
    ) -> int:
        if kind == PLUGIN_CONFIGURATION:
            data = self._config
        elif kind == REQUEST_BODY:
            data = self._body
        else:
            return NOT_FOUND
        self._give(caller, data[start : start + max_size], p_out, s_out)
        return OK

    def _proxy_get_header_map_value(
        self, caller: wasmtime.Caller, kind: int, kp: int, ks: int, p_out: int, s_out: int
    ) -> int:
        if kind != REQUEST_HEADERS:
            return BAD_ARGUMENT
        key = self._read(caller, kp, ks).lower()
        for k, v in self._headers:
            if k == key:
                self._give(caller, v, p_out, s_out)
                return OK
        return NOT_FOUND

    def _proxy_get_header_map_pairs(
        self, caller: wasmtime.Caller, kind: int, p_out: int, s_out: int
    ) -> int:
        if kind != REQUEST_HEADERS:
            return BAD_ARGUMENT
        self._give(caller, _encode_pairs(self._headers), p_out, s_out)
        return OK

    def _proxy_replace_header_map_value(
        self, caller: wasmtime.Caller, kind: int, kp: int, ks: int, vp: int, vs: int
    ) -> int:
        key = self._read(caller, kp, ks).lower()
        self._headers = [(k, v) for k, v in self._headers if k != key]
        self._headers.append((key, self._read(caller, vp, vs)))
        return OK

    def _proxy_remove_header_map_value(
        self, caller: wasmtime.Caller, kind: int, kp: int, ks: int
    ) -> int:
        key = self._read(caller, kp, ks).lower()
        self._headers = [(k, v) for k, v in self._headers if k != key]
        return OK

    def _proxy_send_local_response(
        self,
        caller: wasmtime.Caller,
        code: int,
        dp: int,
        ds: int,
        bp: int,
        bs: int,
        hp: int,
        hs: int,
        grpc_status: int,
    ) -> int:
        self._local = Decision(
            allowed=False,
            status=code,
            grpc_status=None if grpc_status < 0 else grpc_status,
            body=self._read(caller, bp, bs),
            details=self._read(caller, dp, ds).decode(),
            response_headers=_decode_pairs(self._read(caller, hp, hs)),
            request_headers=list(self._headers),
        )
        return OK

    def _proxy_get_shared_data(
        self, caller: wasmtime.Caller, kp: int, ks: int, p_out: int, s_out: int, cas_out: int
    ) -> int:
        item = self.shared.get(self._read(caller, kp, ks))
        if item is None:
            return NOT_FOUND
        self._give(caller, item[0], p_out, s_out)
        self._mem(caller).write(caller, struct.pack("<I", item[1]), cas_out)
        return OK

    def _proxy_set_shared_data(
        self, caller: wasmtime.Caller, kp: int, ks: int, vp: int, vs: int, cas: int
    ) -> int:
        return self.shared.set(self._read(caller, kp, ks), self._read(caller, vp, vs), cas)

    def _proxy_define_metric(
        self, caller: wasmtime.Caller, kind: int, np_: int, ns: int, id_out: int
    ) -> int:
        name = self._read(caller, np_, ns).decode()
        mid = len(self.metric_names) + 1
        self.metric_names[mid] = name
        self.metrics.setdefault(name, 0)
        self._mem(caller).write(caller, struct.pack("<I", mid), id_out)
        return OK

    def _proxy_increment_metric(self, caller: wasmtime.Caller, mid: int, offset: int) -> int:
        if mid not in self.metric_names:
            return NOT_FOUND
        self.metrics[self.metric_names[mid]] += offset
        return OK

    def _proxy_get_property(
        self, caller: wasmtime.Caller, pp: int, ps: int, p_out: int, s_out: int
    ) -> int:
        # The path's parts are separated by NUL, as proxy-wasm SDKs serialize it.
        path = self._read(caller, pp, ps).split(b"\0")
        if path == [b"connection", b"uri_san_peer_certificate"] and self._principal is not None:
            self._give(caller, self._principal, p_out, s_out)
            return OK
        return NOT_FOUND

    def _proxy_get_current_time_nanoseconds(self, caller: wasmtime.Caller, out: int) -> int:
        self._mem(caller).write(caller, struct.pack("<Q", self.now_ns), out)
        return OK


_ENGINE = wasmtime.Engine()
_MODULES: dict[bytes, wasmtime.Module] = {}


def _compiled(raw: bytes) -> tuple[wasmtime.Engine, wasmtime.Module]:
    """Compile each module once per process; every host gets its own Store and instance."""
    if raw not in _MODULES:
        _MODULES[raw] = wasmtime.Module(_ENGINE, raw)
    return _ENGINE, _MODULES[raw]


def _b(x: str | bytes) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


def _encode_pairs(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """ABI 0.2.1 header map, in order (Envoy's proxy_get_header_map_pairs)."""
    sizes = [n for k, v in pairs for n in (len(k), len(v))]
    data = b"".join(k + b"\0" + v + b"\0" for k, v in pairs)
    return struct.pack(f"<I{len(sizes)}I", len(pairs), *sizes) + data


def _decode_pairs(raw: bytes) -> dict[str, str]:
    """ABI 0.2.1 header map: count, (key len, value len) per pair, then `key\\0value\\0`."""
    if len(raw) < 4:
        return {}
    (n,) = struct.unpack_from("<I", raw)
    sizes = struct.unpack_from(f"<{2 * n}I", raw, 4)
    pos, out = 4 + 8 * n, {}
    for i in range(n):
        k = raw[pos : pos + sizes[2 * i]]
        pos += sizes[2 * i] + 1
        v = raw[pos : pos + sizes[2 * i + 1]]
        pos += sizes[2 * i + 1] + 1
        out[k.decode()] = v.decode()
    return out


_IMPORTS = [
    ("proxy_log", [_I32] * 3, [_I32]),
    ("proxy_get_buffer_bytes", [_I32] * 5, [_I32]),
    ("proxy_get_header_map_value", [_I32] * 5, [_I32]),
    ("proxy_get_header_map_pairs", [_I32] * 3, [_I32]),
    ("proxy_replace_header_map_value", [_I32] * 5, [_I32]),
    ("proxy_remove_header_map_value", [_I32] * 3, [_I32]),
    ("proxy_send_local_response", [_I32] * 8, [_I32]),
    ("proxy_get_shared_data", [_I32] * 5, [_I32]),
    ("proxy_set_shared_data", [_I32] * 5, [_I32]),
    ("proxy_define_metric", [_I32] * 4, [_I32]),
    ("proxy_increment_metric", [_I32, _I64], [_I32]),
    ("proxy_get_current_time_nanoseconds", [_I32], [_I32]),
    ("proxy_get_property", [_I32] * 4, [_I32]),
]
_EXPORTS = (
    "proxy_on_vm_start",
    "proxy_on_context_create",
    "proxy_on_configure",
    "proxy_on_request_headers",
    "proxy_on_request_body",
    "proxy_on_request_trailers",
    "proxy_on_done",
    "proxy_on_delete",
    "proxy_on_memory_allocate",
)

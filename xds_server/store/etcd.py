"""The etcd store: etcd v3 through its JSON gateway (POST /v3/...), with the stdlib only.

Why the gateway: it is part of every etcd server, it speaks plain HTTP/1.1 that http.client
does, and the control plane's callers are threads (a blocking client fits them); the Python
gRPC clients either fail with today's protobuf (etcd3) or are asyncio (aetcd). Keys and values
are base64 in the JSON, 64-bit numbers decimal strings (the gateway's proto3 JSON mapping).

With `access` (xds_server/store/etcd_access.py) it speaks HTTPS with a client certificate and
authenticates as an etcd user: POST /v3/auth/authenticate gives a token, sent as the
Authorization header of every call and taken again when etcd says it expired.

Every call has a deadline (`timeout`): an endpoint that refuses the connection or has no raft
leader is skipped for the next one; when none answers in time the call raises
StoreUnavailable, never hangs. All keys live under `root`, so several meshes can share a
cluster.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import itertools
import json
import math
import queue
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from xds_server.store.base import (
    Check,
    Compacted,
    Entry,
    Event,
    LeaseLost,
    Op,
    Put,
    Store,
    StoreError,
    StoreUnavailable,
    Watch,
    conflict,
)
from xds_server.store.etcd_access import EtcdAccess

DEFAULT_TIMEOUT = 2.0
# gRPC codes the gateway passes on (google.rpc.Code)
_INVALID_ARGUMENT, _DEADLINE_EXCEEDED, _NOT_FOUND, _PERMISSION_DENIED = 3, 4, 5, 7
_UNAVAILABLE, _UNAUTHENTICATED = 14, 16
# Ask the member to end a watch when it loses its raft leader (etcd's rpctypes
# MetadataRequireLeaderKey), so a watcher on a cut-off member hears it instead of silence.
_REQUIRE_LEADER = {"Grpc-Metadata-hasleader": "true"}
# What etcd says when a token is no good any more (expired, or auth changed since): take another.
_STALE_TOKEN = ("invalid auth token", "auth store is old", "user name is empty")


class AuthRefused(StoreError):
    """etcd refused the credentials or the permission: the message says which."""


class EtcdStore(Store):
    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        root: str = "/meshlm/",
        timeout: float = DEFAULT_TIMEOUT,
        access: EtcdAccess | None = None,
    ) -> None:
        """`endpoints`: "host:port" of the members' client URLs (HTTPS when `access` has TLS)."""
        if not endpoints:
            raise ValueError("etcd: no endpoint given")
        self.endpoints = [_host_port(e) for e in endpoints]
        self.root = root
        self.timeout = timeout
        self.access = access or EtcdAccess()
        self._preferred = 0  # the endpoint that answered last
        self._token: str | None = None
        self._token_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EtcdStore({self.describe()})"

    def describe(self) -> str:
        scheme = "etcds://" if self.access.tls else "etcd://"
        return scheme + ",".join(f"{h}:{p}" for h, p in self.endpoints) + self.root.rstrip("/")

    # -- reads ----------------------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        doc = self.call("/v3/kv/range", {"key": self._k(key)})
        kvs = doc.get("kvs") or []
        return self._entry(kvs[0]) if kvs else None

    def list(self, prefix: str) -> tuple[list[Entry], int]:
        full = (self.root + prefix).encode()
        doc = self.call("/v3/kv/range", {"key": b64(full), "range_end": b64(range_end(full))})
        return [self._entry(kv) for kv in doc.get("kvs") or []], _rev(doc)

    def revision(self) -> int:
        return _rev(self.call("/v3/kv/range", {"key": self._k(""), "count_only": True}))

    # -- writes ---------------------------------------------------------------------------------
    def txn(self, checks: Sequence[Check], ops: Sequence[Op]) -> int:
        compare = []
        for c in checks:
            if c.created is not None:
                compare.append({"key": self._k(c.key), "target": "CREATE", "result": "EQUAL",
                                "create_revision": str(c.created)})  # fmt: skip
            else:
                compare.append({"key": self._k(c.key), "target": "MOD", "result": "EQUAL",
                                "mod_revision": str(c.revision)})  # fmt: skip
        success = []
        for op in ops:
            if isinstance(op, Put):
                put: dict[str, Any] = {"key": self._k(op.key), "value": b64(op.value)}
                if op.lease:
                    put["lease"] = str(op.lease)
                success.append({"request_put": put})
            else:
                success.append({"request_delete_range": {"key": self._k(op.key)}})
        # On failure, read the checked keys back to say which check failed and why.
        failure = [{"request_range": {"key": self._k(c.key)}} for c in checks]
        doc = self.call("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure})
        if doc.get("succeeded"):
            return _rev(doc)
        for c, resp in zip(checks, doc.get("responses") or [], strict=False):
            kvs = (resp.get("response_range") or {}).get("kvs") or []
            now = self._entry(kvs[0]) if kvs else None
            if c.created is not None:
                holds = (now.created if now else 0) == c.created
            else:
                holds = (now.revision if now else 0) == c.revision
            if not holds:
                raise conflict(c, now)
        raise StoreError("etcd: transaction refused, yet every check holds now: try again")

    # -- leases ---------------------------------------------------------------------------------
    def grant(self, ttl: float) -> int:
        if isinstance(ttl, bool) or not (isinstance(ttl, int | float) and 0 < ttl < math.inf):
            raise ValueError(f"lease ttl: expected seconds > 0, got {ttl!r}")
        # etcd counts whole seconds (and raises a TTL below its minimum to that minimum).
        return int(self.call("/v3/lease/grant", {"TTL": str(math.ceil(ttl))})["ID"])

    def keepalive(self, lease: int) -> float:
        doc = self.call("/v3/lease/keepalive", {"ID": str(lease)}).get("result") or {}
        ttl = int(doc.get("TTL") or 0)  # absent: the lease is gone
        if ttl <= 0:
            raise LeaseLost(f"lease {lease:x}: not found (expired or revoked)")
        return float(ttl)

    def revoke(self, lease: int) -> None:
        with contextlib.suppress(LeaseLost):
            self.call("/v3/lease/revoke", {"ID": str(lease)})

    # -- watches --------------------------------------------------------------------------------
    def watch(self, prefix: str, start_revision: int) -> Watch:
        return _EtcdWatch(self, prefix, start_revision)

    # -- the gateway ----------------------------------------------------------------------------
    def call(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict:
        """POST `body` to the first endpoint that answers, within the deadline, as the
        access's user when it has one."""
        waited = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + waited
        try:
            return self._call(path, body, deadline)
        except StoreUnavailable as e:
            raise StoreUnavailable(str(e).replace("in time", f"within {waited:g}s")) from None

    def _call(self, path: str, body: dict[str, Any], deadline: float) -> dict:
        if self.access.user is None:
            return self._post(path, body, deadline, {})
        token = self.token(deadline)
        try:
            return self._post(path, body, deadline, {"Authorization": token})
        except AuthRefused as e:
            if not any(s in str(e) for s in _STALE_TOKEN):
                raise
        return self._post(path, body, deadline, {"Authorization": self.token(deadline, token)})

    def token(self, deadline: float, stale: str | None = None) -> str:
        """The auth token, taken again when it is `stale` (or none was taken yet)."""
        with self._token_lock:
            if self._token is None or self._token == stale:
                body = {"name": self.access.user, "password": self.access.password}
                self._token = str(self._post("/v3/auth/authenticate", body, deadline, {})["token"])
            return self._token

    def connect(self, i: int, timeout: float) -> http.client.HTTPConnection:
        host, port = self.endpoints[i]
        if self.access.tls is not None:
            return http.client.HTTPSConnection(host, port, timeout=timeout,
                                               context=self.access.tls)  # fmt: skip
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def _post(self, path: str, body: dict[str, Any], deadline: float, headers: dict) -> dict:
        data = json.dumps(body).encode()
        tried: list[str] = []
        # Passes over the members until one answers: during a raft election (a second or
        # two) each says "no leader", and a pass later one of them has it.
        for i in itertools.chain.from_iterable(self._passes(deadline)):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            host, port = self.endpoints[i]
            conn = self.connect(i, left)
            try:
                conn.request("POST", path, data, {"Content-Type": "application/json", **headers})
                resp = conn.getresponse()
                status, raw = resp.status, resp.read()
            except TimeoutError:
                tried.append(f"{host}:{port}: no answer")
                break  # the deadline is spent (the request may have been applied)
            except ssl.SSLCertVerificationError as e:  # no other member will differ
                raise StoreError(f"etcd {host}:{port}: TLS: {e.verify_message or e}") from None
            except OSError as e:  # refused, reset: this member is down, try the next
                tried.append(f"{host}:{port}: {e.strerror or e}")
                continue
            except http.client.HTTPException as e:
                tried.append(f"{host}:{port}: {type(e).__name__}")
                continue
            finally:
                conn.close()
            try:
                doc = json.loads(raw)
            except ValueError:
                raise StoreError(f"etcd {host}:{port}{path}: HTTP {status}, not JSON") from None
            if status == 200:
                self._preferred = i
                return doc
            code, message = doc.get("code"), str(doc.get("message") or doc.get("error") or "")
            if code == _UNAVAILABLE:  # e.g. "etcdserver: no leader": another member may have one
                tried.append(f"{host}:{port}: {message}")
                continue
            if code == _DEADLINE_EXCEEDED:  # "request timed out": no quorum behind it
                tried.append(f"{host}:{port}: {message}")
                break  # (the request may yet be applied)
            if code == _NOT_FOUND and "lease" in message:
                raise LeaseLost(f"etcd: {message}")
            if code in (_INVALID_ARGUMENT, _PERMISSION_DENIED, _UNAUTHENTICATED) and (
                "auth" in message or "permission" in message or "user" in message
            ):
                raise AuthRefused(f"etcd {host}:{port}{path}: {message}")
            raise StoreError(f"etcd {host}:{port}{path}: {message or f'HTTP {status}'}")
        why = "; ".join(dict.fromkeys(tried)) or "no try"
        raise StoreUnavailable(f"etcd {self.describe()}: no answer in time ({why})")

    def _passes(self, deadline: float) -> Iterator[list[int]]:
        """The endpoints in order, again and again (a pause between passes) until `deadline`."""
        while True:
            yield self._order()
            pause = min(0.1, deadline - time.monotonic())
            if pause <= 0:
                return
            time.sleep(pause)

    def _order(self) -> list[int]:
        n = len(self.endpoints)
        return [(self._preferred + j) % n for j in range(n)]

    def _k(self, key: str) -> str:
        return b64((self.root + key).encode())

    def _entry(self, kv: dict) -> Entry:
        return Entry(
            key=self._strip(kv["key"]),
            value=base64.b64decode(kv.get("value") or ""),
            revision=int(kv.get("mod_revision") or 0),
            created=int(kv.get("create_revision") or 0),
            lease=int(kv.get("lease") or 0),
        )

    def _strip(self, b64key: str) -> str:
        return base64.b64decode(b64key).decode()[len(self.root) :]


class _EtcdWatch(Watch):
    """One POST /v3/watch stream (newline-separated JSON messages) read by a thread. When the
    stream breaks it resumes from the next revision on any endpoint; when none takes it
    within the store's deadline, `get` raises StoreUnavailable."""

    def __init__(self, store: EtcdStore, prefix: str, start: int) -> None:
        self._store, self._prefix = store, prefix
        self._next_rev = start
        self._events: queue.Queue[Event | StoreError] = queue.Queue()
        self._closed = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self._failed: StoreError | None = None
        self._stale_token: str | None = None  # a token etcd refused: take another
        self._thread = threading.Thread(target=self._run, name="etcd-watch", daemon=True)
        self._thread.start()

    def get(self, timeout: float | None = None) -> Event | None:
        if self._failed is not None:
            raise self._failed
        try:
            item = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, StoreError):
            self._failed = item
            raise item
        return item

    def close(self) -> None:
        self._closed.set()
        self._events.put(StoreError("watch closed"))
        with self._lock:
            if self._conn is not None and self._conn.sock is not None:
                # Unblocks the reader thread's readline.
                with contextlib.suppress(OSError):
                    self._conn.sock.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        try:
            self._follow()
        except Exception as e:  # a bug or a garbled answer: the watcher hears it
            self._events.put(StoreError(f"etcd watch of {self._prefix!r} failed: {e!r}"))

    def _follow(self) -> None:
        s = self._store
        failures: list[str] = []
        deadline = time.monotonic() + s.timeout
        first = s._preferred
        for attempt in itertools.count():
            if self._closed.is_set():
                return
            i = (first + attempt) % len(s.endpoints)
            host, port = s.endpoints[i]
            try:
                if self._stream(i, deadline):  # it ran, then ended: resume from the next event
                    deadline = time.monotonic() + s.timeout
                    failures.clear()
                    continue
                failures.append(f"{host}:{port}: no watch created")
            except StoreError as e:  # Compacted: the caller lists again
                self._events.put(e)
                return
            except (OSError, http.client.HTTPException, ValueError) as e:
                failures.append(f"{host}:{port}: {getattr(e, 'strerror', None) or e}")
            if time.monotonic() >= deadline:
                if not self._closed.is_set():
                    self._events.put(StoreUnavailable(
                        f"etcd {s.describe()}: watch of {self._prefix!r} lost, not resumed "
                        f"within {s.timeout:g}s ({'; '.join(dict.fromkeys(failures))})"
                    ))  # fmt: skip
                return
            if i == (first - 1) % len(s.endpoints):  # each endpoint tried: a pause
                self._closed.wait(0.1)

    def _stream(self, i: int, deadline: float) -> bool:
        """Read one watch stream until it ends; True when it had been created."""
        s = self._store
        full = (s.root + self._prefix).encode()
        create = {"key": b64(full), "range_end": b64(range_end(full)),
                  "start_revision": str(self._next_rev)}  # fmt: skip
        headers = {"Content-Type": "application/json", **_REQUIRE_LEADER}
        if s.access.user is not None:
            headers["Authorization"] = s.token(deadline, self._stale_token)
            self._stale_token = None
        left = max(0.05, deadline - time.monotonic())
        conn = s.connect(i, left)
        with self._lock:
            if self._closed.is_set():
                return False
            self._conn = conn
        try:
            conn.request("POST", "/v3/watch", json.dumps({"create_request": create}).encode(),
                         headers)  # fmt: skip
            resp = conn.getresponse()
            if resp.status != 200:  # e.g. 503 "etcdserver: no leader"
                message = _message(resp.read())
                if any(t in message for t in _STALE_TOKEN):
                    self._stale_token = headers.get("Authorization")
                raise OSError(f"HTTP {resp.status} {message}".strip())
            created = False
            while not self._closed.is_set():
                line = resp.readline()
                if not line:
                    return created  # the member went away
                if not line.strip():
                    continue
                doc = json.loads(line)
                if "error" in doc:  # refused before it was created (auth, permission)
                    message = _message(line)
                    if any(t in message for t in _STALE_TOKEN):
                        self._stale_token = headers.get("Authorization")
                    raise OSError(message or "watch refused")
                result = doc.get("result") or {}
                if result.get("created"):
                    created = True
                    conn.sock.settimeout(None)  # a watch is silent while nothing changes
                    _keepalive(conn.sock)
                if result.get("canceled"):
                    compact = int(result.get("compact_revision") or 0)
                    if compact:
                        raise Compacted(
                            f"watch from revision {self._next_rev}: compacted up to {compact}"
                        )
                    return created  # e.g. the member lost its leader: resume elsewhere
                for ev in result.get("events") or []:
                    self._events.put(self._event(ev))
            return created
        finally:
            with self._lock:
                self._conn = None
            conn.close()

    def _event(self, ev: dict) -> Event:
        kv = ev.get("kv") or {}
        rev = int(kv.get("mod_revision") or 0)
        self._next_rev = rev + 1
        key = self._store._strip(kv["key"])
        if ev.get("type") == "DELETE":
            return Event("delete", key, b"", rev)
        value = base64.b64decode(kv.get("value") or "")
        return Event("put", key, value, rev, int(kv.get("create_revision") or 0))


def _keepalive(sock: socket.socket) -> None:
    """TCP keep-alive probes, so a watch to a member that vanished ends within ~10 s."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def _host_port(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"etcd endpoint {endpoint!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def range_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's GetPrefixRangeEnd)."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"  # every key


def b64(b: bytes) -> str:
    """Bytes as etcd's JSON gateway takes them: base64 text."""
    return base64.b64encode(b).decode()


def _message(raw: bytes) -> str:
    """The reason in a gateway error body: {"message"} or, from a stream, {"error": {...}}."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return ""
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        doc = doc["error"]
    return str(doc.get("message") or doc.get("error") or "") if isinstance(doc, dict) else ""


def _rev(doc: dict) -> int:
    return int((doc.get("header") or {}).get("revision") or 0)

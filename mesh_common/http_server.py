"""A bounded HTTP/1.1 server on the stdlib's http.server, for every HTTP API of the mesh's own
processes: the runtime's OpenAI and metrics ports, the control plane's admin API.

- Refusals before framing: `header_error` (a subclass's checks of the request's headers alone,
  such as Host and credentials) runs before the framing checks and before any body is read, and
  before a `100 Continue`.
- Framing: a request's body is its `content-length` or its `transfer-encoding: chunked` body,
  read exactly (`read_body`), or the request is refused and its connection closed. A body on a
  method that takes none, both framings at once, another transfer coding, or conflicting
  lengths are refused (their bytes must never become the next request on the connection).
- A whole-request deadline: the request line, headers and body must arrive within
  `request_timeout` of the request's first byte (a client trickling bytes holds its slot no
  longer); between requests a keep-alive connection waits up to `idle_timeout`.
- At most `max_connections` connections, `max_per_peer` of them from one peer address; the
  others get `busy` (a whole HTTP response) and are closed.
- `peer_closed` tells a client that left with poll(), which takes any descriptor number.
"""

from __future__ import annotations

import contextlib
import io
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

IDLE_TIMEOUT_S = 60.0  # a keep-alive connection's wait for its next request, and any write
REQUEST_TIMEOUT_S = 30.0  # a request's line, headers and body, from its first byte
_HEX = frozenset(b"0123456789abcdefABCDEF")
_MAX_TRAILERS = 64


class BodyError(Exception):
    """The body cannot be read: answer `status` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def peer_closed(sock: socket.socket) -> bool:
    """Whether the client closed its end (EOF or reset); data it sent ahead is not a close."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        events = poller.poll(0)
        if not events:
            return False
        if events[0][1] & (select.POLLERR | select.POLLNVAL):
            return True
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True


class _DeadlineIO(socket.SocketIO):
    """A socket's reads, each bounded by what is left of `deadline` (monotonic), if set."""

    deadline: float | None = None

    def __init__(self, sock: socket.socket, idle_timeout: float) -> None:
        super().__init__(sock, "rb")
        self._idle = idle_timeout

    def readinto(self, b: Any) -> int | None:
        if self.deadline is None:
            return super().readinto(b)
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        self._sock.settimeout(left)
        try:
            return super().readinto(b)
        finally:
            with contextlib.suppress(OSError):
                self._sock.settimeout(self._idle)


class BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections`, at most `max_per_peer` per peer."""

    daemon_threads = True
    request_queue_size = 64  # listen backlog (socketserver's default of 5 drops bursts)

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BoundedHandler],
        *,
        max_connections: int,
        max_per_peer: int,
        request_timeout: float,
        busy: bytes,
    ) -> None:
        self.max_connections, self.max_per_peer = max_connections, max_per_peer
        self.request_timeout = request_timeout
        self.busy = busy
        self._lock = threading.Lock()
        self._open = 0
        self._per_peer: dict[str, int] = {}
        super().__init__(address, handler)

    def _admit(self, peer: str) -> bool:
        with self._lock:
            if (
                self._open >= self.max_connections
                or self._per_peer.get(peer, 0) >= self.max_per_peer
            ):
                return False
            self._open += 1
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            return True

    def _release(self, peer: str) -> None:
        with self._lock:
            self._open -= 1
            n = self._per_peer[peer] - 1
            if n:
                self._per_peer[peer] = n
            else:
                del self._per_peer[peer]

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = client_address[0]
        if not self._admit(peer):
            with contextlib.suppress(OSError):
                request.setblocking(False)  # a client that reads nothing holds no thread
                request.send(self.busy)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(peer)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(client_address[0])


class BoundedHandler(BaseHTTPRequestHandler):
    """Framing checks and the whole-request deadline; `read_body` reads the body. Subclasses
    answer errors through `send_error` and set `max_body`."""

    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S
    max_body = 0
    body_methods = frozenset({"POST"})  # methods that may carry a body
    server: BoundedServer
    _headers_checked = False

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced: reads that see the request's deadline
        self._io = _DeadlineIO(self.connection, self.timeout)
        self.rfile = io.BufferedReader(self._io)

    def handle_one_request(self) -> None:
        try:
            if not self.rfile.peek(1):  # the next request's first byte, or the client's close
                self.close_connection = True
                return
        except OSError:  # idle too long, reset
            self.close_connection = True
            return
        self._io.deadline = time.monotonic() + self.server.request_timeout
        try:
            super().handle_one_request()
        finally:
            self._io.deadline = None

    def header_error(self) -> tuple[int, str] | None:
        """(status, message) to refuse the request on its headers alone; None to go on.
        Called once per request, as soon as its line and headers are parsed."""
        return None

    def _check_headers(self) -> tuple[int, str] | None:
        if self._headers_checked:
            return None
        self._headers_checked = True
        return self.header_error()

    def handle_expect_100(self) -> bool:
        # Refuse a request before its client sends the body.
        error = self._check_headers() or self._framing_error() or self.length_error()
        if error is not None:
            self.send_error(*error)
            return False
        return super().handle_expect_100()

    def parse_request(self) -> bool:
        self._headers_checked = False
        if not super().parse_request():  # calls handle_expect_100 on `Expect: 100-continue`
            return False
        error = self._check_headers() or self._framing_error()
        if error is not None:
            self.send_error(*error)
            return False
        return True

    def _framing_error(self) -> tuple[int, str] | None:
        codings = self.headers.get_all("transfer-encoding") or []
        lengths = self.headers.get_all("content-length") or []
        if codings and lengths:
            return 400, "a request may carry transfer-encoding or content-length, not both"
        if codings and (len(codings) > 1 or codings[0].strip().lower() != "chunked"):
            return 501, "the only transfer coding taken is chunked"
        if len(lengths) > 1:
            return 400, "a request may carry one content-length"
        if lengths and not (lengths[0].isdigit() and lengths[0].isascii()):
            return 400, f"content-length {lengths[0][:32]!r} is not a length"
        has_body = bool(codings) or (bool(lengths) and int(lengths[0]) > 0)
        if has_body and self.command not in self.body_methods:
            return 400, f"a {self.command} request takes no body"
        return None

    def length_error(self) -> tuple[int, str] | None:
        """413 when the declared length is over `max_body` (a chunked body is checked as it
        arrives)."""
        raw = self.headers.get("content-length")
        if raw is not None and raw.isdigit() and int(raw) > self.max_body:
            return 413, f"the body's {int(raw)} bytes exceed the limit of {self.max_body}"
        return None

    def read_body(self) -> bytes:
        """The request's whole body (b"" if it has none). Raises BodyError; after one the
        connection must close. Once read, the request's deadline no longer applies."""
        try:
            if self.headers.get("transfer-encoding"):
                body = self._read_chunked()
            else:
                error = self.length_error()
                if error is not None:
                    raise BodyError(*error)
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                if len(body) < n:
                    raise BodyError(400, "the body ended before its content-length")
        except TimeoutError:
            raise BodyError(
                408, f"the request did not arrive within {self.server.request_timeout:g} s"
            ) from None
        except OSError:
            raise BodyError(400, "the connection failed while the body was read") from None
        self._io.deadline = None
        return body

    def _read_chunked(self) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            line = self.rfile.readline(1024)
            size = line.split(b";", 1)[0].strip()
            if not line.endswith(b"\n") or not size or len(size) > 16 or not set(size) <= _HEX:
                raise BodyError(400, "a chunk of the body has no valid size line")
            n = int(size, 16)
            if n == 0:
                break
            total += n
            if total > self.max_body:
                raise BodyError(413, f"the body exceeds the limit of {self.max_body} bytes")
            data = self.rfile.read(n)
            if len(data) < n or self.rfile.readline(3) not in (b"\r\n", b"\n"):
                raise BodyError(400, "a chunk of the body is cut short or not ended by CRLF")
            parts.append(data)
        for _ in range(_MAX_TRAILERS):
            line = self.rfile.readline(8192)
            if line in (b"\r\n", b"\n"):
                return b"".join(parts)
            if not line.endswith(b"\n"):
                break
        raise BodyError(400, "the chunked body's trailer is malformed")

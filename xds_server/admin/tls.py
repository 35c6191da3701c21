"""HTTPS for the admin API of a control plane whose mesh has `identity`.

The certificate comes from the mesh CA: the control plane's SPIFFE ID
(spiffe://<td>/ns/meshlm-system/sa/control-plane) plus DNS SAN `localhost` and an IP SAN of the
bind address (both loopback addresses for a wildcard bind), so a client checks the host name as
it would for any HTTPS server; no workload certificate carries a DNS or IP SAN, so no sidecar can
pose as the admin API. It is renewed at half-life and whenever the CA's signer or trust bundle
changes (root rotation).

Clients find the root to trust in `<run dir>/admin-<port>-ca.pem` (the trust bundle: every root
of the mesh CA live now), written beside the admin token once the port is bound, kept current
through a rotation, and removed at stop. HTTPS rather than a unix socket: `--admin` still works
from another host, and the token travels encrypted wherever the client is.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import socket
import ssl
import threading
import time
from pathlib import Path

from mesh_common.private_files import read_private, write_private
from xds_server.admin.token import run_dir
from xds_server.identity.ca import SERVING_LIFETIME, MeshCA, load_chain_in_memory

log = logging.getLogger(__name__)

_KEPT = "the admin API's CA"  # what the run dir holds, for its errors
_TLS_HANDSHAKE = b"\x16"  # the first byte of every TLS connection (RFC 8446 5.1: handshake(22))
_WILDCARDS = ("", "0.0.0.0", "::")
_LINGER = 1.0  # seconds to read a plaintext request's rest after refusing it (no RST first)


def ca_path(admin_port: int) -> Path:
    return run_dir() / f"admin-{admin_port}-ca.pem"


def read_ca(admin_port: int) -> bytes:
    """The trust bundle a local control plane published for `admin_port` (FileNotFoundError
    when it published none; PrivateFileError when the run dir is not private)."""
    return read_private(ca_path(admin_port), _KEPT)


def drop_ca(admin_port: int) -> None:
    """Remove a CA file left for `admin_port` in a private run dir (by a control plane with
    identity that did not stop cleanly): a plain HTTP one serves that port now."""
    with contextlib.suppress(OSError, ValueError):
        read_ca(admin_port)
        ca_path(admin_port).unlink()


def server_names(host: str) -> tuple[list[str], list[str]]:
    """(DNS SANs, IP SANs) of the admin certificate for a server bound to `host`."""
    if host in _WILDCARDS:
        return ["localhost"], ["127.0.0.1", "::1"]
    try:
        return ["localhost"], [str(ipaddress.ip_address(host.strip("[]")))]
    except ValueError:  # a host name
        return list(dict.fromkeys(["localhost", host])), []


class AdminTLS:
    """The admin server's TLS: the current context, each connection's handshake (in its own
    thread, under a deadline), and the published trust bundle."""

    def __init__(self, ca: MeshCA, host: str, deadline: float) -> None:
        self.ca = ca
        self.dns, self.ips = server_names(host)
        self.deadline = deadline
        self._lock = threading.Lock()
        self._context: ssl.SSLContext | None = None
        self._state: tuple = ()
        self._renew_at = 0.0
        self._published: int | None = None  # the admin port whose CA file we keep
        self._bundle = b""
        self.refresh()

    def refresh(self) -> None:
        """A new certificate at half-life or when the CA's signer or bundle changed."""
        state = self.ca.state_key()
        if state == self._state and time.time() < self._renew_at:
            return
        key, chain = self.ca.server_credentials(self.dns, self.ips)
        context = _server_context(key, chain)
        with self._lock:
            self._context, self._state = context, state
            self._renew_at = time.time() + SERVING_LIFETIME / 2
        bundle = self.ca.bundle_pem()
        if self._published is not None and bundle != self._bundle:
            write_private(ca_path(self._published), bundle, _KEPT)
            log.info("admin API: trust bundle in %s updated", ca_path(self._published))
        self._bundle = bundle

    def publish(self, admin_port: int) -> Path:
        """Write the trust bundle where local clients look for it; returns the path."""
        self._bundle = self.ca.bundle_pem()
        write_private(ca_path(admin_port), self._bundle, _KEPT)
        self._published = admin_port
        return ca_path(admin_port)

    def unpublish(self) -> None:
        """Remove the CA file if it still holds our bundle (not a later server's)."""
        if self._published is None:
            return
        with contextlib.suppress(OSError, ValueError):
            if read_ca(self._published) == self._bundle:
                ca_path(self._published).unlink()
        self._published = None

    def accept(self, sock: socket.socket, admin_url: str) -> ssl.SSLSocket | None:
        """The TLS connection over an accepted socket, or None: a plaintext HTTP request was
        answered 400 (saying to use HTTPS), or the handshake failed or missed the deadline."""
        with self._lock:
            context = self._context
        assert context is not None
        sock.settimeout(self.deadline)
        conn: socket.socket = sock
        # A handshake trickled a byte at a time would hold a connection slot for ever.
        timer = threading.Timer(self.deadline, lambda: _cut(conn))
        timer.daemon = True
        timer.start()
        try:
            first = sock.recv(1, socket.MSG_PEEK)
            if first != _TLS_HANDSHAKE:
                if first:
                    _refuse_plaintext(sock, admin_url)
                return None
            tls = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            conn = tls
            tls.do_handshake()
            return tls
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            log.debug("admin API: TLS handshake failed: %s", e)
            with contextlib.suppress(OSError):
                conn.close()
            return None
        finally:
            timer.cancel()


def _cut(conn: socket.socket) -> None:
    # socket.socket's shutdown, not SSLSocket's: that one also drops the SSL object under the
    # handshake running in the other thread.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(conn, socket.SHUT_RDWR)


def _refuse_plaintext(sock: socket.socket, admin_url: str) -> None:
    """Answer a plain HTTP request 400 with what to do (nginx answers the same mistake so)."""
    head = b""
    with contextlib.suppress(OSError):
        while b"\r\n\r\n" not in head and len(head) < 16384:
            chunk = sock.recv(4096)
            if not chunk:
                break
            head += chunk
    port = admin_url.rsplit(":", 1)[-1]
    error = (
        f"plain HTTP to the HTTPS admin API: use {admin_url} (meshlm finds the mesh CA's root "
        f"in the control plane's run dir, admin-{port}-ca.pem; else pass --cacert FILE)"
    )
    body = json.dumps({"error": error}).encode()
    reply = (
        b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with contextlib.suppress(OSError):
        sock.sendall(reply)
        sock.shutdown(socket.SHUT_WR)
        # Closing with a request body still unread would send RST, which can overtake the reply.
        sock.settimeout(_LINGER)
        while sock.recv(65536):
            pass


def _server_context(key_pem: bytes, chain_pem: bytes) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    load_chain_in_memory(context, chain_pem, key_pem)
    return context

"""The client of the control plane's admin API, shared by `meshlm apply|rollout|identity|status`
and the local mesh launcher: which URL, which token (xds_server/admin/token.py), which root the
server's certificate must chain to when the URL is https:// (xds_server/admin/tls.py), and one
JSON request.

A control plane whose mesh has `identity` serves HTTPS only. Its root is found without flags for
a local one (`<run dir>/admin-<port>-ca.pem`, written by the control plane); for another host,
copy that file and pass `--cacert FILE`. Without `--admin`, the URL is https://127.0.0.1:18001
when that file exists for port 18001, else http://127.0.0.1:18001.
"""

from __future__ import annotations

import argparse
import http.client
import json
import ssl
from typing import Any
from urllib.parse import urlsplit

from mesh_common.private_files import PrivateFileError
from xds_server.admin.tls import ca_path, read_ca
from xds_server.admin.token import LOOPBACK_NAMES, TOKEN_ENV, client_token
from xds_server.identity.ca import CONTROL_PLANE_SA, parse_spiffe_id

DEFAULT_PORT = 18001  # control_plane.admin_port's default


class AdminError(Exception):
    """The admin API cannot be used (safely); the message says why and what to do."""


def add_admin_client_arguments(p: argparse.ArgumentParser, *, token: bool = True) -> None:
    """`--admin`, `--cacert` and (unless `token` is False) `--token-file`, as every client of
    the control plane's admin API takes them."""
    p.add_argument("--admin", help=f"control plane admin URL (default: https://127.0.0.1:"
                   f"{DEFAULT_PORT} when a local control plane with identity published its CA "
                   f"there, else http://127.0.0.1:{DEFAULT_PORT})")  # fmt: skip
    p.add_argument("--cacert", help="PEM file of the mesh CA root(s) an https:// admin's "
                   "certificate must chain to (default: the local control plane's "
                   "admin-PORT-ca.pem in its run dir)")  # fmt: skip
    if token:
        p.add_argument("--token-file", help=f"file holding the admin bearer token (default: "
                       f"${TOKEN_ENV}, else the local control plane's token file)")  # fmt: skip


def local_url(port: int = DEFAULT_PORT) -> str:
    """The URL of the local control plane's admin API on `port`: https:// once it published its
    CA, else http://."""
    return f"{'https' if _published(port) else 'http'}://127.0.0.1:{port}"


class AdminClient:
    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        token_source: str = "",
        cacert: str | None = None,
        guessed: bool = False,
    ) -> None:
        """Raises AdminError for a URL it cannot use or a root it cannot find. `guessed`: the
        URL is the local default (no --admin), its scheme a guess while nothing answers."""
        self.url = url.rstrip("/")
        self.guessed = guessed
        self.token, self.token_source = token, token_source
        u = urlsplit(self.url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise AdminError(f"--admin {url}: expected http://HOST:PORT or https://HOST:PORT")
        self._split = u
        self.context: ssl.SSLContext | None = None
        if u.scheme == "https":
            self.context, self.roots = _client_context(u.hostname, u.port, cacert)
        elif cacert:
            raise AdminError(f"--cacert is for https:// admin URLs, not {url}")
        elif token and u.hostname not in LOOPBACK_NAMES:
            raise AdminError(
                f"refusing to send the admin token over plain HTTP to {u.hostname}: use an "
                "https:// admin URL (a control plane whose mesh has `identity:`)"
            )
        elif u.hostname in LOOPBACK_NAMES and u.port and _published(u.port):
            # Refused before the token is sent: the port is a local control plane's HTTPS.
            https = self.url.replace("http://", "https://", 1)
            raise AdminError(
                f"the control plane at {url} serves HTTPS (its CA is in {ca_path(u.port)}): "
                f"use --admin {https}"
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AdminClient:
        """From add_admin_client_arguments' flags; AdminError (or TokenError) when unusable."""
        url = args.admin or local_url()
        token, source = None, ""
        if hasattr(args, "token_file"):
            token, source = client_token(url, args.token_file)
        return cls(
            url, token=token, token_source=source, cacert=args.cacert, guessed=not args.admin
        )

    def request(
        self, method: str, path: str, body: Any = None, timeout: float = 30.0
    ) -> tuple[int, Any]:
        """(HTTP status, JSON reply) of one call; `body` is bytes as they are, else JSON.
        AdminError when the server cannot be reached or trusted (the token is then not sent)."""
        u = self._split
        if self.context:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                u.hostname, u.port or 443, timeout=timeout, context=self.context
            )
        else:
            conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            conn.connect()
            if self.context:
                self._check_peer(conn.sock)
            conn.request(method, u.path + path, body=data, headers=headers)
            reply = conn.getresponse()
            status, raw = reply.status, reply.read()
        except ssl.SSLCertVerificationError as e:
            raise AdminError(self._untrusted(e)) from None
        except ssl.SSLError as e:
            raise AdminError(
                f"no TLS session with {self.url}: {e.reason or e} (a control plane without "
                "`identity:` serves plain HTTP: use http://)"
            ) from None
        except (OSError, http.client.HTTPException) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise AdminError(self._unreachable(reason)) from None
        finally:
            conn.close()
        try:
            return status, json.loads(raw or b"null")
        except ValueError:
            return status, {"error": raw.decode(errors="replace") or f"HTTP {status}"}

    def _unreachable(self, reason: object) -> str:
        if not self.guessed:
            return (
                f"cannot reach the control plane at {self.url}: {reason} (is `meshlm "
                "xds-server` running there, on that admin port?)"
            )
        return (
            f"cannot reach the control plane at 127.0.0.1:{self._split.port} (the default "
            f"admin port): {reason}. Is `meshlm xds-server` running? Another admin port: "
            "--admin https://127.0.0.1:PORT (http:// for a mesh without identity)"
        )

    def _check_peer(self, sock: Any) -> None:
        # The host name was checked in the handshake; a mesh root also signs every workload,
        # so make sure this is the control plane's identity (no workload has a DNS or IP SAN
        # either, but a user's root may sign other servers).
        uris = [v for k, v in sock.getpeercert().get("subjectAltName", ()) if k == "URI"]
        if not any((parse_spiffe_id(uri) or ("", ""))[1] == CONTROL_PLANE_SA for uri in uris):
            raise AdminError(
                f"{self.url} is not a meshlm control plane: its certificate names "
                f"{', '.join(uris) or 'no SPIFFE ID'}, not .../ns/meshlm-system/sa/control-plane;"
                " not sending the token"
            )

    def _untrusted(self, e: ssl.SSLCertVerificationError) -> str:
        what = e.verify_message or str(e)
        return (
            f"refusing {self.url}: its certificate failed verification against the root(s) in "
            f"{self.roots} ({what}); the token was not sent. If the mesh CA's root changed, "
            "use the control plane's current admin-PORT-ca.pem (its run dir) as --cacert"
        )


def _published(port: int) -> bool:
    try:
        read_ca(port)
    except (OSError, PrivateFileError):
        return False
    return True


def _client_context(host: str, port: int | None, cacert: str | None) -> tuple[ssl.SSLContext, str]:
    """A context trusting only the mesh roots: --cacert, else a local control plane's file."""
    if cacert:
        try:
            context = ssl.create_default_context(cafile=cacert)
        except (OSError, ssl.SSLError) as e:
            raise AdminError(
                f"--cacert {cacert}: not a readable PEM file of certificates: {e}"
            ) from None
        return context, cacert
    if host in LOOPBACK_NAMES and port:
        try:
            pem = read_ca(port).decode()
            return ssl.create_default_context(cadata=pem), str(ca_path(port))
        except FileNotFoundError:
            pass
        except (OSError, PrivateFileError, UnicodeDecodeError) as e:  # SSLError: an OSError
            raise AdminError(f"{ca_path(port)}: cannot use it: {e}") from None
    where = f" and no {ca_path(port)}" if host in LOOPBACK_NAMES and port else ""
    raise AdminError(
        f"https://{host}:{port}: no --cacert FILE{where}: pass --cacert with the mesh CA's root "
        "(the control plane writes it to admin-PORT-ca.pem in its run dir)"
    )

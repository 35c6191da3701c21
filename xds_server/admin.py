"""The admin HTTP API on loopback (stdlib http.server in a thread).

  GET  /debug/syncz                               sync status per sidecar and type, convergence
  GET  /debug/config_dump                         the snapshots being served
  POST /v1/services/{s}/weights                   {"v1": 90, "v2": 10}
  POST /v1/services/{s}/versions/{v}/endpoints    {"add": "host:port"} or {"remove": "host:port"}
  POST /v1/mesh                                   a whole mesh file (YAML); keeps live weights

Mutations need `Authorization: Bearer <token>` and answer once every affected sidecar ACKed
(200), or a sidecar NACKed (409), or the timeout passed (504, naming the sidecars still behind);
`?timeout=SECONDS` (default 10). Other APIs (rollouts) are mounted under their own prefix.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import tempfile
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

from xds_server.control_plane import ApplyResult, ControlPlane
from xds_server.mesh import load_yaml, parse_mesh

log = logging.getLogger(__name__)
# (method, path, body) -> (status, JSON-able reply)
Mount = Callable[[str, str, bytes], tuple[int, Any]]


def make_token_file(port: int, token: str | None = None) -> tuple[str, Path]:
    """A fresh token written to a file only this user can read; returns (token, path)."""
    token = token or secrets.token_urlsafe(32)
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    path = base / f"meshlm-admin-{port}.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return token, path


class AdminServer:
    def __init__(
        self,
        cp: ControlPlane,
        *,
        token: str,
        port: int = 0,
        host: str = "127.0.0.1",
        mounts: dict[str, Mount] | None = None,
    ) -> None:
        if not token:
            raise ValueError("admin token must not be empty")
        self.cp = cp
        self.token = token
        self.mounts = dict(mounts or {})
        handler = type("Handler", (_Handler,), {"admin": self})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> AdminServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="admin", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- routing --------------------------------------------------------------------------------
    def handle(self, method: str, target: str, body: bytes) -> tuple[int, Any]:
        url = urlsplit(target)
        parts = [p for p in url.path.split("/") if p]
        query = parse_qs(url.query)
        if method == "GET" and parts == ["debug", "syncz"]:
            return 200, self.cp.syncz()
        if method == "GET" and parts == ["debug", "config_dump"]:
            return 200, self.cp.config_dump()
        for prefix, mount in self.mounts.items():
            if url.path == prefix or url.path.startswith(prefix.rstrip("/") + "/"):
                return mount(method, target, body)
        if method == "POST" and parts == ["v1", "mesh"]:
            return self._apply_mesh(body, query)
        if method != "POST" or parts[:2] != ["v1", "services"] or len(parts) < 4:
            return 404, {"error": f"no such endpoint: {method} {url.path}"}
        try:
            timeout = float(query.get("timeout", ["10"])[0])
            doc = json.loads(body or b"{}")
            if not isinstance(doc, dict):
                raise ValueError("expected a JSON object")
        except ValueError as e:
            return 400, {"error": f"bad request: {e}"}
        service = parts[2]
        try:
            if len(parts) == 4 and parts[3] == "weights":
                return _outcome(self.cp.set_weights(service, doc, timeout=timeout))
            if len(parts) == 6 and parts[3] == "versions" and parts[5] == "endpoints":
                version = parts[4]
                if set(doc) == {"add"}:
                    r = self.cp.add_endpoint(service, version, doc["add"], timeout=timeout)
                elif set(doc) == {"remove"}:
                    r = self.cp.remove_endpoint(service, version, doc["remove"], timeout=timeout)
                else:
                    return 400, {"error": 'expected {"add": "host:port"} or {"remove": ...}'}
                return _outcome(r)
        except ValueError as e:  # MeshError, or a snapshot the sidecars could not take
            return 400, {"error": str(e)}
        return 404, {"error": f"no such endpoint: {method} {url.path}"}

    def _apply_mesh(self, body: bytes, query: dict[str, list[str]]) -> tuple[int, Any]:
        """`POST /v1/mesh` with a mesh file (YAML or JSON): `meshlm apply`."""
        try:
            timeout = float(query.get("timeout", ["10"])[0])
            mesh = parse_mesh(load_yaml(body or b"", "mesh"))
            return _outcome(self.cp.apply_mesh(mesh, timeout=timeout))
        except yaml.YAMLError as e:
            return 400, {"error": f"mesh: not YAML: {e}"}
        except ValueError as e:  # MeshError names the field; nothing was pushed
            return 400, {"error": str(e)}

    def authorized(self, header: str | None) -> bool:
        scheme, _, presented = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            presented.strip().encode(), self.token.encode()
        )


def _outcome(r: ApplyResult) -> tuple[int, Any]:
    if r.ok:
        return 200, r.to_json()
    return (409 if r.errors else 504), r.to_json()


class _Handler(BaseHTTPRequestHandler):
    admin: AdminServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_OPTIONS(self) -> None:
        self._serve("OPTIONS")

    def do_HEAD(self) -> None:
        self._reply(405, {"error": "HEAD is not supported"}, body=False)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own errors (bad request line, unknown method, huge headers) as JSON;
        # an unknown method is the client's error (405), not the server's (501).
        self.close_connection = True
        code = 405 if code == 501 else code
        self._reply(code, {"error": message or self.responses.get(code, ("error",))[0]})

    def _serve(self, method: str) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            return self._reply(400, {"error": "bad Content-Length"})
        body = self.rfile.read(length) if length else b""
        if method != "GET" and not self.admin.authorized(self.headers.get("Authorization")):
            status, reply = 401, {"error": "mutations need Authorization: Bearer <admin token>"}
        else:
            try:
                status, reply = self.admin.handle(method, self.path, body)
            except Exception as e:  # never kill the admin thread; say what went wrong
                log.exception("admin %s %s", method, self.path)
                status, reply = 500, {"error": f"{type(e).__name__}: {e}"}
        self._reply(status, reply)

    def _reply(self, status: int, reply: Any, *, body: bool = True) -> None:
        data = json.dumps(reply, indent=1, default=str).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data) if body else 0))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("admin: " + format, *args)

"""The admin HTTP API on loopback (stdlib http.server in a thread).

  GET  /healthz, /readyz                          alive; ready to serve ADS
  (xds_server/xds/health.py)
  GET  /debug/syncz                               sync status per sidecar and type, convergence
  GET  /metrics                                   Prometheus text (xds_server/admin/metrics.py)
  GET  /debug/config_dump                         the snapshots being served
  POST /v1/services/{s}/weights                   {"v1": 90, "v2": 10}; ?force=1 (see below)
  POST /v1/services/{s}/versions/{v}/endpoints    {"add": "host:port"} or {"remove": "host:port"}
  POST /v1/mesh                                   a whole mesh file (YAML); keeps live weights
  GET  /traffic                                   versions given traffic that cannot take it
  GET  /budgets                                   tenants' token budgets (global mode: what is left)
  GET  /isolation                                 quarantined request classes per service
  POST /isolation/{s}/{class}/release|pin         end a quarantine / hold one until released
  GET  /identity, POST /identity/tokens           the mesh CA; join tokens
  (xds_server/identity/workload.py)
  GET  /dashboard/, /dashboard/state|events       the live dashboard (xds_server/admin/dashboard/)

Mutations need `Authorization: Bearer <token>` and answer once every affected sidecar ACKed
(200), or a sidecar NACKed (409), or the timeout passed (504, naming the sidecars still behind);
`?timeout=SECONDS` (default 10). Weights that send traffic to a version with no endpoint in the
mesh are refused (409) unless `?force=1`; to one whose endpoints answer no probe they are set,
with a `warnings` list in the reply (xds_server/admin/traffic.py). Other APIs (rollouts) are
mounted under their own prefix.

With an `identity` block in the mesh the port serves HTTPS only, with a certificate of the mesh
CA (xds_server/admin/tls.py; clients find the root in the run dir); a plain HTTP request gets a
400 saying so. Without one it is plain HTTP.

Hardened for a loopback port that any local process (or a browser page, by DNS rebinding) can
reach: the Host header must name a loopback address with the admin port (403); the token is
checked before any body is read (401); a body needs a Content-Length of at most MAX_BODY (411,
413); a request must arrive within READ_DEADLINE; at most MAX_CONNECTIONS are served at once
(503); JSON nested too deeply is refused (400).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

from mesh_common.http_server import BodyError, BoundedHandler, BoundedServer
from xds_server.admin import budgets as token_budgets
from xds_server.admin import faults
from xds_server.admin import traffic as traffic_check
from xds_server.admin.dashboard.service import Busy, Dashboard
from xds_server.admin.metrics import ControlPlaneMetrics, Exposition
from xds_server.admin.tls import AdminTLS, drop_ca
from xds_server.control_plane import ApplyResult
from xds_server.mesh import load_yaml, parse_mesh
from xds_server.server import XdsServer
from xds_server.store.base import Conflict, StoreError
from xds_server.xds import health

log = logging.getLogger(__name__)
# (method, path, body) -> (status, JSON-able reply)
Mount = Callable[[str, str, bytes], tuple[int, Any]]


MAX_BODY = 4 << 20  # bytes: a mesh file with thousands of tenants
MAX_CONNECTIONS = 32
READ_DEADLINE = 5.0  # seconds for a request's line, headers and body (slowloris)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


class AdminServer:
    def __init__(
        self,
        cp: XdsServer,
        *,
        token: str,
        port: int = 0,
        host: str = "127.0.0.1",
        mounts: dict[str, Mount] | None = None,
        status: Callable[[], dict[str, Any]] | None = None,
        metrics: ControlPlaneMetrics | None = None,
        dashboard: Dashboard | None = None,
        faults_file: str | Path | None = None,
    ) -> None:
        """`mounts`: more APIs by path prefix (rollouts, the SLO loop). `status()`: the reply to
        GET / (which replica this is and which leads). `metrics` and `dashboard` read the
        rollouts and SLO loops running here (default: none); the dashboard is closed at stop()."""
        if not token:
            raise ValueError("admin token must not be empty")
        self.cp = cp
        self.token = token
        self.mounts = dict(mounts or {})
        # Without a token, as every GET: scrapers hold no secret, and nothing in it is one.
        self.metrics = metrics or ControlPlaneMetrics(cp)
        self.status = status
        self.dashboard = dashboard or Dashboard(cp, lambda: (None, None))
        # GET /isolation, POST /isolation/{service}/{class}/release|pin
        self.mounts.setdefault("/isolation", cp.isolation.handle)
        self.mounts.setdefault("/traffic", traffic_check.handle(cp))
        self.mounts.setdefault("/budgets", token_budgets.handle(cp))
        # `faults_file`: the faults set here, kept across a restart (restored at start()).
        self.faults_file = faults.FaultFile(faults_file) if faults_file else None
        self.mounts.setdefault(faults.PREFIX, faults.handle(cp, file=self.faults_file))
        self.fault_expiry = faults.FaultExpiry(cp, file=self.faults_file)
        if cp.identity:  # GET /identity, POST /identity/tokens|rotate-root
            self.mounts.setdefault("/identity", cp.identity.handle)
        self.host = host
        # HTTPS whenever the mesh has a CA: the token never travels in the clear.
        self.tls = AdminTLS(cp.identity.ca, host, READ_DEADLINE) if cp.identity else None
        handler = type("Handler", (_Handler,), {"admin": self})
        self.httpd = _AdminHTTPServer((host, port), handler, self.tls)
        self.port = self.httpd.server_address[1]
        self.httpd.url = self.url
        # DNS rebinding: a browser page's requests carry the page's host name in Host.
        names = {*LOOPBACK_HOSTS, f"[{host}]" if ":" in host else host} - {"0.0.0.0", "[::]"}
        self.hosts = {f"{name}:{self.port}" for name in names}
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def publish_ca(self) -> Path | None:
        """With HTTPS, write the mesh CA's trust bundle where local clients find it (the run
        dir, beside the admin token) and keep it current; returns its path. Without, remove a
        file left there for this port by an earlier control plane that did not stop cleanly."""
        if self.tls:
            return self.tls.publish(self.port)
        drop_ca(self.port)
        return None

    def start(self) -> AdminServer:
        if self.faults_file is not None:
            restored = self.faults_file.restore(self.cp, time.time())
            if restored:
                log.info("faults restored: %s", ", ".join(restored))
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="admin", daemon=True)
        self._thread.start()
        self.fault_expiry.start()
        return self

    def stop(self) -> None:
        self.fault_expiry.stop()
        self.dashboard.close()  # ends the event streams, which no shutdown() waits for
        if self._thread is not None:  # shutdown() waits for a serve_forever() that never ran
            self.httpd.shutdown()
        self.httpd.server_close()
        if self.tls:
            self.tls.unpublish()

    # -- routing --------------------------------------------------------------------------------
    def handle(self, method: str, target: str, body: bytes) -> tuple[int, Any]:
        url = urlsplit(target)
        parts = [p for p in url.path.split("/") if p]
        query = parse_qs(url.query)
        if method == "GET" and not parts and self.status is not None:
            return 200, self.status()  # which replica this is and which leads
        if method == "GET" and parts in (["healthz"], ["readyz"]):
            return health.http(parts[0], self.cp.readiness)  # no token: kubelet probes hold none
        if method == "GET" and parts == ["debug", "syncz"]:
            return 200, self.cp.syncz()
        if method == "GET" and parts == ["metrics"]:
            return 200, self.metrics.exposition()
        if method == "GET" and parts == ["debug", "config_dump"]:
            return 200, self.cp.config_dump()
        if method == "GET" and parts[:1] == ["dashboard"]:
            return self._dashboard(parts[1:])
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
        except RecursionError:
            return 400, {"error": "bad request: JSON nested too deeply"}
        except ValueError as e:
            return 400, {"error": f"bad request: {e}"}
        service = parts[2]
        try:
            if len(parts) == 4 and parts[3] == "weights":
                return self._set_weights(service, doc, timeout, query)
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
        except StoreError as e:  # replicas: the store refused or did not answer
            return _store_error(e)
        return 404, {"error": f"no such endpoint: {method} {url.path}"}

    def _set_weights(
        self, service: str, weights: dict, timeout: float, query: dict[str, list[str]]
    ) -> tuple[int, Any]:
        """Weights, refused (409) while they send traffic to a version with no endpoint at all
        unless `?force=1`; a version whose endpoints answer no probe is a warning."""
        force = query.get("force", ["0"])[0].lower() in ("1", "true", "yes")
        stranded = traffic_check.stranded(self.cp, service, weights)
        refused = [s.message for s in stranded if s.no_endpoint]
        if refused and not force:
            why = "; ".join(refused)
            return 409, {"error": f"{why}; to set them anyway: meshlm weights --force (?force=1)"}
        status, reply = _outcome(self.cp.set_weights(service, weights, timeout=timeout))
        if stranded:
            reply["warnings"] = [s.message for s in stranded]
        return status, reply

    def _dashboard(self, rest: list[str]) -> tuple[int, Any]:
        if rest == ["state"]:
            return 200, self.dashboard.snapshot()
        page = self.dashboard.file("/".join(rest))
        if page is None:
            return 404, {"error": f"no such endpoint: GET /dashboard/{'/'.join(rest)}"}
        return 200, Exposition(*page)

    def _apply_mesh(self, body: bytes, query: dict[str, list[str]]) -> tuple[int, Any]:
        """`POST /v1/mesh` with a mesh file (YAML or JSON): `meshlm apply`."""
        try:
            timeout = float(query.get("timeout", ["10"])[0])
            source = load_yaml(body or b"", "mesh")
            mesh = parse_mesh(source)
            if mesh.authz.keys_file != self.cp.mesh.authz.keys_file:
                # Else any token holder could make the control plane read any file.
                return 400, {
                    "error": "authz.keys_file: cannot be changed over the admin API "
                    "(restart the control plane with the new mesh file)"
                }
            return _outcome(self.cp.apply_mesh(mesh, timeout=timeout, source=source))
        except StoreError as e:
            return _store_error(e)
        except yaml.YAMLError as e:
            return 400, {"error": f"mesh: not YAML: {e}"}
        except ValueError as e:  # MeshError names the field; nothing was pushed
            return 400, {"error": str(e)}

    def host_allowed(self, header: str | None) -> bool:
        return (header or "").strip().lower() in self.hosts

    def authorized(self, header: str | None) -> bool:
        scheme, _, presented = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            presented.strip().encode(), self.token.encode()
        )


def _store_error(e: StoreError) -> tuple[int, Any]:
    """409 when the store refused the write (it kept changing under us), else 503: the store
    did not answer (no quorum, partitioned); the write may still land, so read before retrying."""
    return (409 if isinstance(e, Conflict) else 503), {"error": f"state store: {e}"}


def _outcome(r: ApplyResult) -> tuple[int, Any]:
    if r.ok:
        return 200, r.to_json()
    return (409 if r.errors else 504), r.to_json()


class _AdminHTTPServer(BoundedServer):
    """The shared bounded server with the admin API's limits; with `tls`, each connection's
    handshake runs in its thread (a slow one holds no other back)."""

    url = ""  # the admin API's own URL, named in the reply to a plain HTTP request
    _BUSY = (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b'Connection: close\r\nContent-Length: 39\r\n\r\n{"error": "too many admin connections"}'
    )

    def __init__(self, address: tuple[str, int], handler: type, tls: AdminTLS | None) -> None:
        self.tls = tls
        super().__init__(
            address,
            handler,
            max_connections=MAX_CONNECTIONS,
            max_per_peer=MAX_CONNECTIONS,  # local clients share one peer address
            request_timeout=READ_DEADLINE,
            busy=self._BUSY,
        )

    def service_actions(self) -> None:  # serve_forever() calls this every half second
        if self.tls:
            try:
                self.tls.refresh()
            except Exception:  # keep serving with the certificate it has
                log.exception("admin API: cannot renew its certificate or trust bundle")

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is None:
            return super().finish_request(request, client_address)
        conn = self.tls.accept(request, self.url)
        if conn is None:
            return None
        try:
            return super().finish_request(conn, client_address)
        finally:
            self.shutdown_request(conn)


class _Handler(BoundedHandler):
    admin: AdminServer
    timeout = READ_DEADLINE  # a keep-alive connection's wait for its next request, any write
    max_body = MAX_BODY
    # Bodies are read, by Content-Length, on every method the API serves; HEAD takes none.
    body_methods = frozenset({"GET", "POST", "DELETE", "PUT", "PATCH", "OPTIONS"})

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

    def header_error(self) -> tuple[int, str] | None:
        if self.command not in self.body_methods:
            return None  # HEAD and unknown methods: 405 whatever they carry
        status, error = self._refuse(self.command)
        if not status:
            return None
        self._audit(self.command, status, {"error": error})
        return status, error

    def _serve(self, method: str) -> None:
        try:
            body = self.read_body()
        except BodyError as e:
            self.close_connection = True
            self._audit(method, e.status, {"error": e.message})
            return self._reply(e.status, {"error": e.message})
        if method == "GET" and urlsplit(self.path).path == "/dashboard/events":
            return self._events()
        try:
            status, reply = self.admin.handle(method, self.path, body)
        except RecursionError:  # a mounted API's JSON parser
            status, reply = 400, {"error": "bad request: JSON nested too deeply"}
        except Exception as e:  # never kill the admin thread; say what went wrong
            log.exception("admin %s %s", method, self.path)
            status, reply = 500, {"error": f"{type(e).__name__}: {e}"}
        self._audit(method, status, reply)
        self._reply(status, reply)

    def _audit(self, method: str, status: int, reply: Any) -> None:
        """One line per admin change, refused ones too: who (the peer, and a
        fingerprint of the token, never the token), what (method and path), the result."""
        if method in ("GET", "HEAD", "OPTIONS"):
            return
        auth = self.headers.get("Authorization")
        if self.admin.authorized(auth):
            digest = hashlib.sha256(self.admin.token.encode()).hexdigest()[:8]
            who = f"token sha256:{digest}"
        else:
            who = "bad token" if auth else "no token"
        peer = f"{self.client_address[0]}:{self.client_address[1]}"
        result = str(status)
        if isinstance(reply, dict) and reply.get("version"):
            result += f" version {reply['version']} ok={reply.get('ok')}"
        level = logging.INFO if status < 400 else logging.WARNING
        what = f"{method} {urlsplit(self.path).path}"
        extra = {"event": "admin", "peer": peer, "who": who, "what": what, "status": status}
        log.log(level, "admin %s by %s (%s): %s", what, peer, who, result, extra=extra)

    def _events(self) -> None:
        """Server-sent events until the page or the admin server goes (one thread each)."""
        self.close_connection = True

        def send(chunk: bytes) -> None:
            self.wfile.write(chunk)
            self.wfile.flush()

        try:
            self.admin.dashboard.stream(lambda chunk: self._start_events(send, chunk))
        except Busy as e:
            if not self._events_started:
                self._reply(503, {"error": str(e)})
        except OSError:  # the page went away
            pass

    _events_started = False

    def _start_events(self, send: Callable[[bytes], None], chunk: bytes) -> None:
        if not self._events_started:
            self._events_started = True
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
        send(chunk)

    def _refuse(self, method: str) -> tuple[int, str]:
        """(status, error) when the request must be refused before its body is read."""
        if not self.admin.host_allowed(self.headers.get("Host")):
            return 403, f"the Host header must be one of {', '.join(sorted(self.admin.hosts))}"
        if method != "GET" and not self.admin.authorized(self.headers.get("Authorization")):
            return 401, "mutations need Authorization: Bearer <admin token>"
        if self.headers.get("Transfer-Encoding"):
            return 411, "send the body with a Content-Length, not chunked"
        # RFC 9112 6.3: a request with neither Content-Length nor Transfer-Encoding has no body.
        raw = self.headers.get("Content-Length") or "0"
        if not raw.isdigit():
            return 400, "bad Content-Length"
        if int(raw) > MAX_BODY:
            return 413, f"a body of {int(raw)} bytes is over the limit of {MAX_BODY}"
        return 0, ""

    def _reply(self, status: int, reply: Any, *, body: bool = True) -> None:
        if isinstance(reply, Exposition):
            data, content_type = reply.body, reply.content_type
        else:
            data, content_type = (
                json.dumps(reply, indent=1, default=str).encode(),
                "application/json",
            )
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data) if body else 0))
        # The dashboard's page: its own scripts and styles only, never inside another page.
        self.send_header("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("admin: " + format, *args)

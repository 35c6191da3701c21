"""Workload identity in the control plane: join tokens and the CSR signing service.

`/meshlm.identity.v1.CertificateService/CreateCertificate` (modelled on Istio's
`IstioCertificateService/CreateCertificate`) takes `{"csr": PEM, "validity_duration": seconds}`
and answers `{"cert_chain": [PEM, ...], "trust_bundle": [PEM, ...], "spiffe_id", "not_after"}`.
JSON, not FlatBuffers or protobuf: one small call per sidecar per half-life, every field is PEM
text already, and it needs no generated code on either side (the agent lives in `sidecar/`, which
imports nothing of the control plane).

The identity signed is decided by the credential, never by the request: a join token (metadata
`authorization: Bearer ...`, single use, stored as a SHA-256 only) grants its service account;
a client certificate of this CA grants the identity in its URI SAN (renewal). Python gRPC cannot
ask for a client certificate without requiring one, so the two credentials have two TLS ports:
`control_plane.ca_port` (server TLS only: enrolment by join token; the agent verifies the port
against the roots its token file carries, `ca.roots`) and `control_plane.ca_mtls_port`
(client certificate required: renewal), served by their own gRPC server in the control plane's
event loop (not on the ADS port, mTLS too when identity is on; this method refuses plaintext).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
from cryptography import x509

from mesh_common.private_files import read_private, write_private
from xds_server import mesh as m
from xds_server.identity import ca as ca_mod
from xds_server.identity.ca import CsrError, MeshCA, NotGranted
from xds_server.mesh.fields import only_known

log = logging.getLogger("meshlm.identity")

SERVICE = "meshlm.identity.v1.CertificateService"
METHOD = "CreateCertificate"
MAX_REQUEST = 64 << 10  # bytes: a CSR is under 1 KiB
TOKEN_PREFIX = "mjt1."
DEFAULT_TOKEN_TTL = 3600.0
MAX_TOKEN_TTL = 7 * 86400.0
_KEEP_EXPIRED = 86400.0  # an expired token is still named as expired (not unknown) this long
_TOKENS_FILE = "join_tokens.json"
_KEPT = "join tokens"  # what the private dir holds, for its errors
REFRESH_INTERVAL = 2.0  # seconds between checks for a new CA certificate or trust bundle


class Refused(Exception):
    """A call the signing service refuses: the gRPC status and a message without secrets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def token_id(token: str) -> str:
    """What logs and files name a token by: a prefix of its SHA-256, never the token."""
    return _digest(token)[:12]


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class JoinTokens:
    """Single-use join tokens, each for one service account until it expires. Only hashes are
    kept (in memory, and 0600 in `path` so that unused tokens outlive a restart)."""

    def __init__(self, path: Path | None = None, clock: Callable[[], float] = time.time) -> None:
        self._path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._by_hash: dict[str, dict[str, Any]] = {}
        try:
            raw = read_private(path, _KEPT) if path else None
        except FileNotFoundError:
            raw = None
        if raw is not None:
            try:
                self._by_hash = dict(json.loads(raw)["tokens"])
            except (ValueError, KeyError, TypeError) as e:
                raise ca_mod.CaError(f"{path}: not a join token file ({e})") from None

    def issue(self, service_account: str, ttl: float = DEFAULT_TOKEN_TTL) -> tuple[str, float]:
        """A new token for `service_account` ("ns/sa") and when it expires (unix time)."""
        if not m.SERVICE_ACCOUNT.match(service_account or ""):
            raise ValueError(f"service_account: expected NAMESPACE/NAME, got {service_account!r}")
        if service_account == ca_mod.CONTROL_PLANE_SA:  # sidecars trust it on ADS
            raise ValueError(f"service_account: {service_account} is the control plane's own")
        if not 0 < ttl <= MAX_TOKEN_TTL:
            raise ValueError(f"ttl: must be more than 0s and at most {MAX_TOKEN_TTL:g}s")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        expires_at = self._clock() + ttl
        with self._lock:
            self._prune()
            self._by_hash[_digest(token)] = {
                "service_account": service_account,
                "expires_at": expires_at,
                "used_at": None,
            }
            self._save()
        return token, expires_at

    def check(self, token: str, *, redeem: bool = False) -> str:
        """The service account `token` grants; with `redeem` it is used up. Refused when the
        token is unknown, expired or used before (a replay)."""
        tid = token_id(token)
        with self._lock:
            entry = self._by_hash.get(_digest(token))
            now = self._clock()
            if entry is None:
                raise Refused(grpc.StatusCode.UNAUTHENTICATED, f"join token {tid}: unknown")
            sa = entry["service_account"]
            if entry["used_at"] is not None:
                raise Refused(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"join token {tid} ({sa}): already used at "
                    f"{time.strftime('%H:%M:%S', time.localtime(entry['used_at']))} (replay)",
                )
            if entry["expires_at"] <= now:
                raise Refused(grpc.StatusCode.UNAUTHENTICATED, f"join token {tid} ({sa}): expired")
            if redeem:
                entry["used_at"] = now
                self._save()
            return sa

    def count(self) -> dict[str, int]:
        now = self._clock()
        with self._lock:
            unused = [e for e in self._by_hash.values() if e["used_at"] is None]
            return {
                "unused": sum(e["expires_at"] > now for e in unused),
                "used": len(self._by_hash) - len(unused),
            }

    def _prune(self) -> None:
        cutoff = self._clock() - _KEEP_EXPIRED
        self._by_hash = {h: e for h, e in self._by_hash.items() if e["expires_at"] > cutoff}

    def _save(self) -> None:
        if self._path:
            write_private(self._path, json.dumps({"tokens": self._by_hash}).encode(), _KEPT)


class CertificateService:
    """CreateCertificate: validate, authenticate, check the asked identity, sign."""

    def __init__(self, ca: MeshCA, tokens: JoinTokens) -> None:
        self.ca = ca
        self.tokens = tokens
        self.issued = 0
        self.refused = 0

    async def create_certificate(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return self.create(request, context.auth_context(), context.invocation_metadata())
        except Refused as r:
            self.refused += 1
            log.warning("CreateCertificate from %s refused: %s", context.peer(), r.message)
            await context.abort(r.code, r.message)
            raise  # not reached: abort raises

    def create(self, request: bytes, auth: dict[str, list[bytes]], metadata: Any) -> bytes:
        if auth.get("transport_security_type") != [b"ssl"]:
            raise Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                "CreateCertificate is served on the CA's TLS ports only (control_plane.ca_port)",
            )
        csr, ttl = self._parse(request)
        bearer = _bearer(metadata)
        peer = auth.get("x509_pem_cert")
        if peer:  # renewal: the identity is the one in the client certificate
            identity, how = self._peer_identity(peer[0]), "renewal"
        elif bearer is not None:
            sa = self.tokens.check(bearer)
            identity, how = (
                ca_mod.spiffe_id(self.ca.trust_domain, sa),
                f"join token {token_id(bearer)}",
            )
        else:
            raise Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                "no credential: send a join token (authorization: Bearer ...) on the CA port, "
                "or renew with the current certificate on the CA's mTLS port",
            )
        try:
            ca_mod.check_csr(csr, identity)
        except NotGranted as e:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"{how}: {e}") from None
        except CsrError as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if bearer is not None and not peer:
            self.tokens.check(bearer, redeem=True)  # only now: bad input does not use it up
        chain = self.ca.sign(csr, identity, ttl)
        leaf = x509.load_pem_x509_certificate(chain[0].encode())
        self.issued += 1
        log.info(
            "issued %s (serial %x, until %s) by %s",
            identity,
            leaf.serial_number,
            leaf.not_valid_after_utc.isoformat(),
            how,
        )
        return json.dumps(
            {
                "cert_chain": chain,
                "trust_bundle": [ca_mod.pem(c) for c in self.ca.trust_bundle()],
                "spiffe_id": identity,
                "not_after": leaf.not_valid_after_utc.timestamp(),
            }
        ).encode()

    def _parse(self, request: bytes) -> tuple[x509.CertificateSigningRequest, float]:
        def bad(msg: str) -> Refused:
            return Refused(grpc.StatusCode.INVALID_ARGUMENT, msg)

        if len(request) > MAX_REQUEST:
            raise bad(f"request: {len(request)} bytes, at most {MAX_REQUEST}")
        try:
            doc = json.loads(request)
        except (ValueError, RecursionError):
            raise bad("request: expected a JSON object {csr, validity_duration}") from None
        if not isinstance(doc, dict):
            raise bad("request: expected a JSON object {csr, validity_duration}")
        for k in doc:
            if k not in ("csr", "validity_duration"):
                raise bad(
                    f"request.{m.field_name(k)}: unknown field (allowed: csr, validity_duration)"
                )
        if not isinstance(doc.get("csr"), str):
            raise bad("request.csr: expected a PEM certificate signing request")
        try:
            csr = x509.load_pem_x509_csr(doc["csr"].encode())
        except ValueError:
            raise bad("request.csr: not a PEM certificate signing request") from None
        ttl = doc.get("validity_duration", self.ca.cert_ttl)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl != ttl:
            raise bad(f"request.validity_duration: expected seconds, got {ttl!r}")
        if ttl < ca_mod.MIN_TTL:
            raise bad(f"request.validity_duration: at least {ca_mod.MIN_TTL:g} seconds")
        return csr, min(float(ttl), self.ca.cert_ttl)  # the mesh's cert_ttl is the most

    def _peer_identity(self, cert_pem: bytes) -> str:
        """The workload identity of a client certificate the TLS layer verified."""
        cert = x509.load_pem_x509_certificate(cert_pem)
        identity = ca_mod.workload_id(cert, self.ca.trust_domain)
        if identity is None:
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"client certificate: expected one workload SPIFFE ID of trust domain "
                f"{self.ca.trust_domain}, got {ca_mod.uri_sans(cert) or 'none'}",
            )
        return identity


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class Identity:
    """The control plane's identity part: CA, join tokens, signing service, admin API."""

    def __init__(self, cfg: m.Identity, state_dir: str | Path | None = None) -> None:
        root = (cfg.root_cert_file, cfg.root_key_file) if cfg.root_cert_file else None
        self.ca = MeshCA(cfg.trust_domain, cfg.cert_ttl, root_files=root, state_dir=state_dir)
        tokens_path = Path(state_dir) / _TOKENS_FILE if state_dir else None
        self.tokens = JoinTokens(tokens_path)
        self.service = CertificateService(self.ca, self.tokens)
        self.ca_address = ""  # host:port once bound
        self.ca_mtls_address = ""
        self._host = ""
        self._ports: tuple[int, ...] = ()
        self._served: tuple[bytes, bytes, bytes] = (b"", b"", b"")
        self._server: grpc.aio.Server | None = None
        self._refresher: asyncio.Task | None = None

    async def start(self, host: str, ca_port: int, mtls_port: int) -> None:
        """Serve CreateCertificate on the two TLS ports (in the control plane's event loop)."""
        self._host = host
        self._server = await self._serve(ca_port, mtls_port)
        self._refresher = asyncio.create_task(self._refresh())

    async def stop(self) -> None:
        if self._refresher:
            self._refresher.cancel()
        if self._server:
            await self._server.stop(0.5)

    async def _serve(self, ca_port: int, mtls_port: int) -> grpc.aio.Server:
        # Credentials are fixed per server: gRPC's dynamic credentials call back into Python in
        # the middle of a handshake, and with a fork (a sidecar starting Envoy in the same
        # process) that deadlocked handshakes. So a change of the CA's certificate or bundle
        # restarts this small server on the same ports instead (clients retry).
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {METHOD: grpc.unary_unary_rpc_method_handler(self.service.create_certificate)},
                )
            ]
        )
        self._served = self._tls_state()
        key, chain, bundle = self._served
        bound = []
        for port, client_auth in ((ca_port, False), (mtls_port, True)):
            creds = grpc.ssl_server_credentials(
                [(key, chain)], bundle if client_auth else None, client_auth
            )
            try:
                got = server.add_secure_port(f"{self._host}:{port}", creds)
            except RuntimeError:
                got = 0
            if not got or (port and got != port):
                raise OSError(f"CA port {self._host}:{port}: cannot bind")
            bound.append(got)
        await server.start()
        client_host = "127.0.0.1" if self._host in ("0.0.0.0", "::", "") else self._host
        self.ca_address, self.ca_mtls_address = (f"{client_host}:{p}" for p in bound)
        self._ports = tuple(bound)
        return server

    def _tls_state(self) -> tuple[bytes, bytes, bytes]:
        key, chain, _ = self.ca.serving_credentials()
        return key, chain, self.ca.bundle_pem()

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_INTERVAL)
            state = self._tls_state()
            if state[1:] == self._served[1:]:
                continue
            log.info("CA ports: new serving certificate or trust bundle; restarting them")
            await self._server.stop(0.5)
            while True:
                try:
                    self._server = await self._serve(*self._ports)
                    break
                except OSError as e:  # the old sockets may take a moment to go
                    log.warning("CA ports: %s; trying again", e)
                    await asyncio.sleep(0.2)

    # -- admin API: /identity -------------------------------------------------------------------
    def handle(self, method: str, target: str, body: bytes) -> tuple[int, Any]:
        """GET /identity; POST /identity/tokens {service_account, ttl}; POST
        /identity/rotate-root {activate_after, overlap}. The admin server asks a POST for the
        admin token before it gets here."""
        parts = [p for p in urlsplit(target).path.split("/") if p][1:]
        if method == "GET" and not parts:
            return 200, self.status()
        if method != "POST" or parts not in (["tokens"], ["rotate-root"]):
            return 404, {"error": f"no such endpoint: {method} {urlsplit(target).path}"}
        try:
            doc = json.loads(body or b"{}")
            if not isinstance(doc, dict):
                raise ValueError("expected a JSON object")
        except ValueError as e:
            return 400, {"error": f"bad request: {e}"}
        try:
            if parts == ["tokens"]:
                return 200, self._issue(doc)
            only_known(doc, "body", {"activate_after", "overlap"})
            kw = {k: m.parse_duration(v, k) for k, v in doc.items()}
            out = self.ca.rotate_root(**kw)
            log.info("root rotation started: new root %s", out["root_sha256"])
            return 200, out
        except ValueError as e:  # MeshError, CaError: the message names the field
            return 400, {"error": str(e)}

    def _issue(self, doc: dict[str, Any]) -> dict[str, Any]:
        only_known(doc, "body", {"service_account", "ttl"})
        sa = doc.get("service_account")
        if not isinstance(sa, str) or not m.SERVICE_ACCOUNT.match(sa):
            raise ValueError(f"service_account: expected NAMESPACE/NAME, got {sa!r}")
        ttl = m.parse_duration(doc.get("ttl", DEFAULT_TOKEN_TTL), "ttl")
        token, expires_at = self.tokens.issue(sa, ttl)
        log.info("join token %s issued for %s", token_id(token), sa)
        roots = self.ca.trust_bundle()
        return {
            "token": token,
            "service_account": sa,
            "spiffe_id": ca_mod.spiffe_id(self.ca.trust_domain, sa),
            "expires_at": expires_at,
            "ca": {
                "address": self.ca_address,
                "mtls_address": self.ca_mtls_address,
                "server_name": ca_mod.CA_SERVER_NAME,
                "root_sha256": [ca_mod.spki_sha256(c) for c in roots],
                "roots": [ca_mod.pem(c) for c in roots],  # the agent trusts the CA port by these
            },
        }

    def status(self) -> dict[str, Any]:
        return {
            **self.ca.status(),
            "ca_address": self.ca_address,
            "ca_mtls_address": self.ca_mtls_address,
            "issued": self.service.issued,
            "refused": self.service.refused,
            "join_tokens": self.tokens.count(),
        }

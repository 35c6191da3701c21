"""The sidecar's workload identity agent: its key, its CSR, its certificate, its renewals.

The agent makes an EC P-256 key, sends a CSR to the mesh CA (xds_server/identity/workload.py) and
serves the certificate to its Envoy by SDS (sidecar/sds.py). The key never leaves this process and
the sidecar's private dir. The first certificate needs a join token file (`meshlm identity token`:
the token, the CA's addresses, its roots and their pins); at that first contact gRPC verifies the CA
port against the roots in the file, once each has matched its pin (a file altered or cut short is
refused, and the agent asks nothing of the CA port it has not verified). Renewals go to the CA's
mTLS port with the current certificate, at half-life (sooner after an error), each with a new key;
the trust bundle that comes back replaces `ROOTCA`, so a root rotation reaches Envoy with the next
renewal.

Key, chain and bundle are kept 0600 in `credentials.json` in the private dir, so a sidecar
restarted while the control plane is down boots with its current certificate.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from mesh_common.private_files import private_dir, read_private, write_private
from sidecar.sds import MAX_SOCKET_PATH, SdsServer, SecretStore

CREDENTIALS_FILE = "credentials.json"
SOCKET_NAME = "sds.sock"
_KEPT = "a private key"  # what the private dir holds, for its errors
# The mesh CA's signing method (xds_server/identity/workload.py): JSON in, JSON out.
CREATE_CERTIFICATE = "/meshlm.identity.v1.CertificateService/CreateCertificate"
CALL_TIMEOUT = 10.0
MAX_RETRY = 30.0  # seconds between tries at most (less when the certificate expires sooner)


class IdentityError(Exception):
    """Why no certificate could be had this time; never holds key or token material."""


@dataclass
class Credentials:
    key_pem: str
    chain: list[str]  # leaf first
    bundle: list[str]  # trusted roots
    spiffe_id: str
    not_after: float
    received_at: float
    ca: dict[str, Any]  # address, mtls_address, server_name
    used_token: str = ""  # SHA-256 of the join token it came from: never sent again
    serial: str = field(default="", compare=False)

    @property
    def renew_at(self) -> float:
        return self.received_at + (self.not_after - self.received_at) / 2


class IdentityAgent:
    def __init__(
        self,
        state_dir: str | Path,
        *,
        join_token_file: str | Path | None = None,
        ttl: float | None = None,
        on_event: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`state_dir`: the sidecar's private dir (made 0700; refused if others can read it);
        `ttl`: the lifetime to ask for (None: the CA's cert_ttl)."""
        self.dir = Path(state_dir)
        if len(self.socket_path.encode()) > MAX_SOCKET_PATH:
            raise ValueError(
                f"identity dir {self.dir}: too long for the SDS socket in it (a unix "
                f"socket path holds {MAX_SOCKET_PATH} bytes)"
            )
        private_dir(self.dir, _KEPT)  # PrivateFileError (a ValueError) names the fix
        self.join_token_file = Path(join_token_file) if join_token_file else None
        self.ttl = ttl
        self.on_event = on_event or (lambda msg: None)
        self._clock = clock
        self.store = SecretStore()
        self.current: Credentials | None = None
        self.renewals = 0
        self._sds: SdsServer | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def socket_path(self) -> str:
        return str(self.dir / SOCKET_NAME)

    @property
    def spiffe_id(self) -> str | None:
        return self.current.spiffe_id if self.current else None

    def start(self) -> IdentityAgent:
        """Serve SDS (with the persisted certificate if it is still valid), then get or renew
        certificates in a thread."""
        private_dir(self.dir, _KEPT)
        Path(self.socket_path).unlink(missing_ok=True)  # a dead sidecar's socket
        self._sds = SdsServer(self.store, self.socket_path).start()
        cur = self._load()
        if cur:
            self._install(cur, "persisted certificate", save=False)
        self._thread = threading.Thread(target=self._run, name="identity", daemon=True)
        self._thread.start()
        return self

    def wait_ready(self, timeout: float = 30.0) -> bool:
        return self._ready.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=CALL_TIMEOUT + 5)
        if self._sds:
            self._sds.stop()
            Path(self.socket_path).unlink(missing_ok=True)

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        delay = 1.0
        while not self._stop.is_set():
            cur = self.current
            now = self._clock()
            if cur and cur.renew_at > now:
                self._stop.wait(min(cur.renew_at - now, 3600))
                continue
            try:
                if cur and cur.not_after > now:
                    self._install(self._renew(cur), "renewed")
                    self.renewals += 1
                else:
                    self._install(self._enroll(cur), "issued")
                delay = 1.0
            except Exception as e:  # whatever failed, the agent keeps its certificate and retries
                if not isinstance(e, IdentityError):
                    e = IdentityError(f"{type(e).__name__}: {e}")
                left = (cur.not_after - now) / 4 if cur and cur.not_after > now else MAX_RETRY
                delay = max(0.5, min(delay, left))
                self.on_event(f"identity: {e}; trying again in {delay:.1f}s{_standing(cur, now)}")
                self._stop.wait(delay)
                delay = min(delay * 2, MAX_RETRY)

    def _install(self, cred: Credentials, how: str, *, save: bool = True) -> None:
        if save:
            write_private(self.dir / CREDENTIALS_FILE, json.dumps(asdict(cred)).encode(), _KEPT)
        self.current = cred
        self.store.set(
            "".join(cred.chain).encode(), cred.key_pem.encode(), "".join(cred.bundle).encode()
        )
        self._ready.set()
        until = time.strftime("%H:%M:%S", time.localtime(cred.not_after))
        renew = time.strftime("%H:%M:%S", time.localtime(cred.renew_at))
        self.on_event(
            f"identity {cred.spiffe_id}: {how} (serial {cred.serial}, valid until "
            f"{until}, renewal at {renew}, {len(cred.bundle)} trusted root(s))"
        )

    def _load(self) -> Credentials | None:
        path = self.dir / CREDENTIALS_FILE
        try:
            cred = Credentials(**json.loads(read_private(path, _KEPT)))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as e:
            self.on_event(f"identity: {path} unreadable ({type(e).__name__}); enrolling anew")
            return None
        if cred.not_after <= self._clock():
            self.on_event(f"identity {cred.spiffe_id}: the persisted certificate expired")
            return None
        return cred

    # -- talking to the CA --------------------------------------------------------------------
    def _enroll(self, cur: Credentials | None) -> Credentials:
        doc, token = self._read_join_token()
        digest = hashlib.sha256(token.encode()).hexdigest()
        if cur and cur.used_token == digest:
            raise IdentityError(
                f"the certificate expired and the join token in "
                f"{self.join_token_file} was used already: put a new one there"
            )
        ca = doc["ca"]
        creds = grpc.ssl_channel_credentials(root_certificates="".join(ca["roots"]).encode())
        cred = self._call(
            ca, ca["address"], creds, doc["spiffe_id"], [("authorization", f"Bearer {token}")]
        )
        cred.used_token = digest
        return cred

    def _renew(self, cur: Credentials) -> Credentials:
        creds = grpc.ssl_channel_credentials(
            root_certificates="".join(cur.bundle).encode(),
            private_key=cur.key_pem.encode(),
            certificate_chain="".join(cur.chain).encode(),
        )
        cred = self._call(cur.ca, cur.ca["mtls_address"], creds, cur.spiffe_id, [])
        cred.used_token = cur.used_token
        return cred

    def _call(
        self,
        ca: dict[str, Any],
        address: str,
        creds: grpc.ChannelCredentials,
        identity: str,
        metadata: list[tuple[str, str]],
    ) -> Credentials:
        key = ec.generate_private_key(ec.SECP256R1())
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([]))
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity)]), True
            )
            .sign(key, hashes.SHA256())
        )
        body: dict[str, Any] = {"csr": csr.public_bytes(serialization.Encoding.PEM).decode()}
        if self.ttl:
            body["validity_duration"] = self.ttl
        options = [("grpc.ssl_target_name_override", ca["server_name"])]
        try:
            with grpc.secure_channel(address, creds, options=options) as channel:
                reply = channel.unary_unary(CREATE_CERTIFICATE)(
                    json.dumps(body).encode(), timeout=CALL_TIMEOUT, metadata=metadata
                )
        except grpc.RpcError as e:
            raise IdentityError(f"CA at {address}: {e.code().name}: {e.details()}") from None
        received = self._clock()
        try:
            doc = json.loads(reply)
            chain, bundle = list(doc["cert_chain"]), list(doc["trust_bundle"])
            leaf = x509.load_pem_x509_certificate(chain[0].encode())
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise IdentityError(f"CA at {address}: not a certificate reply ({e})") from None
        mine = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        theirs = leaf.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        if mine != theirs or not bundle:
            raise IdentityError(f"CA at {address}: the certificate is not for this key")
        return Credentials(
            key_pem=key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ).decode(),
            chain=chain,
            bundle=bundle,
            spiffe_id=str(doc.get("spiffe_id", identity)),
            not_after=leaf.not_valid_after_utc.timestamp(),
            received_at=received,
            ca={k: ca[k] for k in ("address", "mtls_address", "server_name")},
            serial=f"{leaf.serial_number:x}",
        )

    def _read_join_token(self) -> tuple[dict[str, Any], str]:
        path = self.join_token_file
        if path is None:
            raise IdentityError("no certificate yet and no join token file (--join-token-file)")
        try:
            st = os.stat(path)
            if st.st_mode & 0o077:
                raise IdentityError(
                    f"join token file {path}: mode {st.st_mode & 0o777:04o}, "
                    "others may read it (chmod 600)"
                )
            doc = json.loads(Path(path).read_text())
            token = doc["token"]
            ca = doc["ca"]
            if not (isinstance(token, str) and isinstance(doc["spiffe_id"], str)):
                raise TypeError("token and spiffe_id must be strings")
            missing = {"address", "mtls_address", "server_name", "root_sha256"} - set(ca)
            if missing:
                raise KeyError(f"ca.{min(missing)}")
        except FileNotFoundError:
            raise IdentityError(f"join token file {path}: missing") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise IdentityError(
                f"join token file {path}: not one `meshlm identity token` "
                f"wrote ({type(e).__name__}: {e})"
            ) from None
        if "roots" not in ca:
            raise IdentityError(
                f"join token file {path}: no ca.roots (an older meshlm wrote it): get a new "
                "one with `meshlm identity token`"
            )
        check_roots(ca["roots"], ca["root_sha256"], f"join token file {path}")
        return doc, token


def _standing(cur: Credentials | None, now: float) -> str:
    """What a failed renewal means for calls: a sidecar user wants to know how long it has."""
    if cur is None:
        return ""
    if cur.not_after <= now:
        return (
            ". The certificate expired: calls to and from this sidecar fail until it gets a "
            "new one, with a new join token in --join-token-file (meshlm identity token --out)"
        )
    until = time.strftime("%H:%M:%S", time.localtime(cur.not_after))
    left = int(cur.not_after - now)
    return (
        f". The certificate is valid until {until} (in {left // 60}m{left % 60:02d}s): calls "
        "keep working until then; after that they fail until a renewal succeeds (once it has "
        "expired, only a new join token gets a certificate)"
    )


def check_roots(roots: Any, pins: Any, where: str) -> None:
    """IdentityError unless `roots` are PEM certificates whose public keys each hash to one of
    `pins` ("sha256:<hex>" of the SubjectPublicKeyInfo, as the CA writes them): a token file
    cut short or edited by hand is refused before anything in it is trusted."""
    if not (isinstance(roots, list) and roots and all(isinstance(r, str) for r in roots)):
        raise IdentityError(f"{where}: ca.roots: expected a list of PEM certificates")
    if not (isinstance(pins, list) and all(isinstance(p, str) for p in pins)):
        raise IdentityError(f"{where}: ca.root_sha256: expected a list of sha256:<hex> pins")
    for i, text in enumerate(roots):
        try:
            cert = x509.load_pem_x509_certificate(text.encode())
        except ValueError:
            raise IdentityError(f"{where}: ca.roots[{i}]: not a PEM certificate") from None
        spki = cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        if "sha256:" + hashlib.sha256(spki).hexdigest() not in pins:
            raise IdentityError(
                f"{where}: ca.roots[{i}] matches no pin of ca.root_sha256 (the file was "
                "altered: get a new one with `meshlm identity token`)"
            )

"""The mesh CA: signs workloads' CSRs with SPIFFE identities.

Its own self-signed root by default, kept 0600 in a private state dir so that a restarted control
plane still vouches for the certificates it issued; or, with `identity.root` in the mesh file, an
intermediate (made at start, key in memory only) signed by the user's root, which alone is then
in the trust bundle. Workload keys never come here: the CA sees only CSRs.

Root rotation (self-signed mode) is SPIRE's prepare / activate / retire: a new root first joins
the trust bundle only, so every agent picks it up at its next renewal (`activate_after`, default
one cert_ttl: agents renew at half-life); then it signs; the old root leaves the bundle only once
every certificate it signed has expired (`overlap`, default another cert_ttl). Signing with the
new root at once would break calls to sidecars that still trust only the old one.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import json
import os
import re
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mesh_common.private_files import read_private, write_private

# spiffe://<trust domain>/ns/<namespace>/sa/<service account> (Istio's layout)
_SEGMENT = r"[a-zA-Z0-9][a-zA-Z0-9_.-]*"
_SPIFFE_ID = re.compile(rf"^spiffe://([a-z0-9][a-z0-9._-]*)/ns/({_SEGMENT})/sa/({_SEGMENT})\Z")

ROOT_LIFETIME = 10 * 365 * 86400.0  # Istio's self-signed root: 10 years
INTERMEDIATE_LIFETIME = 365 * 86400.0
SERVING_LIFETIME = 86400.0  # the CA ports' own certificate, renewed at half-life
MIN_TTL = 10.0  # seconds; below this a certificate is renewed more often than it is used
BACKDATE = 30.0  # seconds of clock skew between hosts a fresh certificate tolerates
CA_SERVER_NAME = "meshlm-ca"  # DNS SAN of the CA ports' certificate (agents check it)
CONTROL_PLANE_SA = "meshlm-system/control-plane"
_STATE_FILE = "ca.json"
_KEPT = "CA keys"  # what the private dir holds, for its errors


class CaError(ValueError):
    """A CA that cannot be set up; the message names the field or file."""


class CsrError(ValueError):
    """A CSR that cannot be signed (bad input); the message names what is wrong."""


class NotGranted(CsrError):
    """The CSR asks for an identity the caller's credential does not grant."""


def spiffe_id(trust_domain: str, service_account: str) -> str:
    ns, sa = service_account.split("/", 1)
    return f"spiffe://{trust_domain}/ns/{ns}/sa/{sa}"


def parse_spiffe_id(uri: str) -> tuple[str, str] | None:
    """(trust domain, "ns/sa") of a workload SPIFFE ID, or None."""
    m = _SPIFFE_ID.match(uri)
    return (m.group(1), f"{m.group(2)}/{m.group(3)}") if m else None


def uri_sans(cert: x509.Certificate | x509.CertificateSigningRequest) -> list[str]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return ext.value.get_values_for_type(x509.UniformResourceIdentifier)


def workload_id(cert: x509.Certificate, trust_domain: str) -> str | None:
    """The workload SPIFFE ID of `trust_domain` that is `cert`'s only URI SAN, else None."""
    uris = uri_sans(cert)
    parsed = parse_spiffe_id(uris[0]) if len(uris) == 1 else None
    return uris[0] if parsed and parsed[0] == trust_domain else None


def spki_sha256(cert: x509.Certificate) -> str:
    """The pin of a root (kubeadm's discovery-token-ca-cert-hash): SHA-256 of its public key."""
    der = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(der).hexdigest()


def pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def key_pem(key: Any) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_chain_in_memory(context: ssl.SSLContext, chain_pem: bytes, key_pem: bytes) -> None:
    """`context.load_cert_chain` from PEM bytes. It reads files only: an anonymous memory file
    keeps the key off every disk."""
    fd = os.memfd_create("meshlm-tls-key", os.MFD_CLOEXEC)
    try:
        os.write(fd, chain_pem + key_pem)
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


@dataclass
class _Root:
    cert: x509.Certificate
    key: Any  # None for the user's root (its key signs the intermediate at start only)
    activate_at: float  # signs from then on (before: in the trust bundle only)
    retire_at: float | None = None  # leaves the trust bundle then


class MeshCA:
    def __init__(
        self,
        trust_domain: str = "meshlm.local",
        cert_ttl: float = 900.0,
        *,
        root_files: tuple[str, str] | None = None,
        state_dir: str | Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`root_files` (cert, key): run as an intermediate of that root. `state_dir`: where a
        self-signed root is kept (0700 dir, 0600 file); None keeps it in memory only."""
        self.trust_domain = trust_domain
        self.cert_ttl = cert_ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._state = Path(state_dir) / _STATE_FILE if state_dir and not root_files else None
        self._intermediate: tuple[x509.Certificate, Any] | None = None
        self._serving: tuple[bytes, bytes, float, tuple] | None = None  # key, chain, renew, state
        if root_files:
            self._roots = [self._user_root(*root_files)]
        else:
            self._roots = self._load() or [self._new_root(activate_at=clock())]
            self._save()

    # -- roots ----------------------------------------------------------------------------------
    def _user_root(self, cert_file: str, key_file: str) -> _Root:
        try:
            cert = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
        except (OSError, ValueError) as e:
            raise CaError(f"identity.root.cert_file: cannot read a PEM certificate: {e}") from None
        try:
            key = serialization.load_pem_private_key(Path(key_file).read_bytes(), None)
        except (OSError, ValueError, TypeError) as e:
            raise CaError(
                f"identity.root.key_file: cannot read an unencrypted PEM key: {e}"
            ) from None
        try:
            is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            is_ca = False
        if not is_ca:
            raise CaError("identity.root.cert_file: not a CA certificate (basicConstraints CA)")
        if key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ) != cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ):
            raise CaError("identity.root.key_file: not the key of identity.root.cert_file")
        now = self._clock()
        if cert.not_valid_after_utc.timestamp() <= now + self.cert_ttl:
            raise CaError("identity.root.cert_file: expired or expires within one cert_ttl")
        lifetime = min(INTERMEDIATE_LIFETIME, cert.not_valid_after_utc.timestamp() - now)
        ikey = new_key()
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshlm"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"meshlm intermediate {self.trust_domain}"),
            ]
        )
        inter = self._ca_cert(name, ikey, cert.subject, key, lifetime, path_length=0)
        self._intermediate = (inter, ikey)
        return _Root(cert=cert, key=None, activate_at=0.0)

    def _new_root(self, activate_at: float) -> _Root:
        key = new_key()
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshlm"),
                x509.NameAttribute(
                    NameOID.COMMON_NAME, f"meshlm root {self.trust_domain} {int(self._clock())}"
                ),
            ]
        )
        cert = self._ca_cert(name, key, name, key, ROOT_LIFETIME, path_length=1)
        return _Root(cert=cert, key=key, activate_at=activate_at)

    def _ca_cert(
        self, name: x509.Name, key: Any, issuer: x509.Name, issuer_key: Any, life: float, **kw: Any
    ) -> x509.Certificate:
        now = dt.datetime.fromtimestamp(self._clock(), dt.UTC)
        b = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(seconds=BACKDATE))
            .not_valid_after(now + dt.timedelta(seconds=life))
            .add_extension(x509.BasicConstraints(ca=True, path_length=kw["path_length"]), True)
            .add_extension(_key_usage(cert_sign=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.UniformResourceIdentifier(f"spiffe://{self.trust_domain}")]
                ),
                critical=False,
            )
        )
        return b.sign(issuer_key, hashes.SHA256())

    def _live_roots(self) -> list[_Root]:
        now = self._clock()
        return [r for r in self._roots if r.retire_at is None or r.retire_at > now]

    def _signer(self) -> tuple[x509.Certificate, Any, list[x509.Certificate]]:
        """(certificate, key, intermediates for the chain) that signs leaves now."""
        if self._intermediate:
            cert, key = self._intermediate
            return cert, key, [cert]
        now = self._clock()
        active = [r for r in self._live_roots() if r.activate_at <= now]
        root = max(active, key=lambda r: r.activate_at)
        return root.cert, root.key, []

    def trust_bundle(self) -> list[x509.Certificate]:
        """The roots a workload trusts now (old and new both during a rotation)."""
        with self._lock:
            return [r.cert for r in self._live_roots()]

    def bundle_pem(self) -> bytes:
        return "".join(pem(c) for c in self.trust_bundle()).encode()

    def pins(self) -> list[str]:
        return [spki_sha256(c) for c in self.trust_bundle()]

    def state_key(self) -> tuple:
        """Changes whenever the bundle or the signer does (time moves phases on too)."""
        with self._lock:
            cert, _, _ = self._signer()
            return (cert.serial_number, tuple(r.cert.serial_number for r in self._live_roots()))

    def rotate_root(
        self, *, activate_after: float | None = None, overlap: float | None = None
    ) -> dict[str, Any]:
        """Start a root rotation (see module doc); the new root's pin and the phase times."""
        if self._intermediate:
            raise CaError(
                "identity.root: the root is the user's; rotate it by giving the control plane "
                "a new identity.root (and keeping the old one trusted meanwhile)"
            )
        now = self._clock()
        activate_after = self.cert_ttl if activate_after is None else activate_after
        overlap = self.cert_ttl if overlap is None else overlap
        if activate_after < 0 or overlap < 0:
            raise CaError("rotate: activate_after and overlap must not be negative")
        with self._lock:
            new = self._new_root(activate_at=now + activate_after)
            for r in self._live_roots():
                if r.retire_at is None:
                    r.retire_at = new.activate_at + overlap
            self._roots = [*self._live_roots(), new]
            self._save()
        return {
            "root_sha256": spki_sha256(new.cert),
            "activate_at": new.activate_at,
            "old_roots_retire_at": new.activate_at + overlap,
        }

    # -- signing --------------------------------------------------------------------------------
    def sign(self, csr: x509.CertificateSigningRequest, identity: str, ttl: float) -> list[str]:
        """The PEM chain (leaf first) of a certificate for `identity` (a SPIFFE ID) on the CSR's
        key. The CSR must ask for that identity or for none (`NotGranted`)."""
        check_csr(csr, identity)
        now = self._clock()
        with self._lock:
            signer, signer_key, chain = self._signer()
            not_after = min(now + ttl, signer.not_valid_after_utc.timestamp())
            leaf = _leaf(csr.public_key(), identity, signer, signer_key, now, not_after)
        return [pem(leaf), *(pem(c) for c in chain)]

    def serving_credentials(self) -> tuple[bytes, bytes, bool]:
        """(key PEM, chain PEM, changed) for the CA's own TLS ports: a fresh certificate at
        half-life or when the signer changed."""
        key = self.state_key()
        now = self._clock()
        with self._lock:
            cur = self._serving
            if cur and cur[2] > now and cur[3] == key:
                return cur[0], cur[1], False
            skey, full = self._server_certificate((CA_SERVER_NAME,), (), now)
            self._serving = (skey, full, now + SERVING_LIFETIME / 2, key)
            return skey, full, True

    def server_credentials(self, dns: Sequence[str], ips: Sequence[str]) -> tuple[bytes, bytes]:
        """(key PEM, chain PEM) of a new certificate for a TLS port of the control plane (its
        SPIFFE ID, and these DNS and IP SANs), valid SERVING_LIFETIME: the admin API's."""
        with self._lock:
            return self._server_certificate(dns, ips, self._clock())

    def _server_certificate(
        self, dns: Sequence[str], ips: Sequence[str], now: float
    ) -> tuple[bytes, bytes]:
        # Under self._lock. The chain ends with the signer's root, so a client holding only a
        # pin of that root can find it in the handshake.
        skey = new_key()
        signer, signer_key, chain = self._signer()
        leaf = _leaf(
            skey.public_key(),
            spiffe_id(self.trust_domain, CONTROL_PLANE_SA),
            signer,
            signer_key,
            now,
            min(now + SERVING_LIFETIME, signer.not_valid_after_utc.timestamp()),
            dns=dns,
            ips=ips,
        )
        root = self._roots[0].cert if self._intermediate else signer
        return key_pem(skey), "".join(pem(c) for c in (leaf, *chain, root)).encode()

    def status(self) -> dict[str, Any]:
        with self._lock:
            signer, _, _ = self._signer()
            roots = [
                {
                    "sha256": spki_sha256(r.cert),
                    "subject": r.cert.subject.rfc4514_string(),
                    "not_after": r.cert.not_valid_after_utc.isoformat(),
                    "activate_at": r.activate_at,
                    "retire_at": r.retire_at,
                }
                for r in self._live_roots()
            ]
        return {
            "trust_domain": self.trust_domain,
            "cert_ttl_s": self.cert_ttl,
            "mode": "intermediate" if self._intermediate else "self-signed root",
            "signer": signer.subject.rfc4514_string(),
            "roots": roots,
        }

    # -- persistence (self-signed mode) -----------------------------------------------------------
    def _load(self) -> list[_Root] | None:
        if self._state is None:
            return None
        try:
            raw = read_private(self._state, _KEPT)
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw)
            roots = [
                _Root(
                    cert=x509.load_pem_x509_certificate(r["cert"].encode()),
                    key=serialization.load_pem_private_key(r["key"].encode(), None),
                    activate_at=float(r["activate_at"]),
                    retire_at=r.get("retire_at"),
                )
                for r in doc["roots"]
            ]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CaError(
                f"{self._state}: not a meshlm CA state file ({e}); move it away to "
                "start a new root (every issued certificate then stops being trusted)"
            ) from None
        now = self._clock()
        roots = [r for r in roots if r.retire_at is None or r.retire_at > now]
        return roots or None

    def _save(self) -> None:
        if self._state is None:
            return
        doc = {
            "format": 1,
            "roots": [
                {
                    "cert": pem(r.cert),
                    "key": key_pem(r.key).decode(),
                    "activate_at": r.activate_at,
                    "retire_at": r.retire_at,
                }
                for r in self._roots
            ],
        }
        write_private(self._state, json.dumps(doc).encode(), _KEPT)


def check_csr(csr: x509.CertificateSigningRequest, identity: str) -> None:
    """CsrError unless `csr` is well signed, has a key Envoy takes, and asks for `identity` or
    nothing (NotGranted when it asks for anything else: another SPIFFE ID, a DNS name...)."""
    if not csr.is_signature_valid:
        raise CsrError("csr: its signature does not verify")
    key = csr.public_key()
    if isinstance(key, ec.EllipticCurvePublicKey):
        if key.curve.name not in ("secp256r1", "secp384r1"):
            raise CsrError(f"csr: EC curve {key.curve.name} (expected P-256 or P-384)")
    elif isinstance(key, rsa.RSAPublicKey):
        if not 2048 <= key.key_size <= 4096:
            raise CsrError(f"csr: RSA key of {key.key_size} bits (expected 2048 to 4096)")
    else:
        raise CsrError(f"csr: {type(key).__name__} keys are not taken (EC P-256 or RSA)")
    try:
        sans = list(csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        sans = []
    asked = [getattr(s, "value", s) for s in sans]
    if any(a != identity for a in asked) or len(asked) > 1:
        raise NotGranted(
            f"csr: asks for {', '.join(map(str, asked))}; the credential grants {identity}"
        )


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=not cert_sign,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _leaf(
    public_key: Any,
    identity: str,
    signer: x509.Certificate,
    signer_key: Any,
    now: float,
    not_after: float,
    dns: Sequence[str] = (),
    ips: Sequence[str] = (),
) -> x509.Certificate:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity)]
    names += [x509.DNSName(d) for d in dns]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
    start = max(now - BACKDATE, signer.not_valid_before_utc.timestamp())
    utc = dt.UTC
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))  # SPIFFE: the identity is the URI SAN (critical then)
        .issuer_name(signer.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(dt.datetime.fromtimestamp(start, utc))
        .not_valid_after(dt.datetime.fromtimestamp(not_after, utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(names), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signer_key.public_key()), False
        )
        .sign(signer_key, hashes.SHA256())
    )

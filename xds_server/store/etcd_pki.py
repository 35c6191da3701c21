"""Credentials for a local etcd (`meshlm etcd`): a CA made for it alone, one certificate its
members serve clients and peers with, one client certificate, and the passwords of etcd's root
user and of the `meshlm` user the replicas log in as. All in private files (0600 in 0700 dirs);
the CA's key is used once and never written, so nothing can issue another certificate.

  DIR/members/  ca.pem member.pem member-key.pem   (what the etcd members read)
  DIR/client/   ca.pem client.pem client-key.pem user password   (a store URL's creds=DIR)
  DIR/root-password                                 (etcd's root user, for an operator)
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import secrets
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mesh_common.private_files import private_dir, write_private
from xds_server.identity.ca import key_pem, new_key, pem

USER = "meshlm"
LIFETIME = dt.timedelta(days=365)


class EtcdPki:
    def __init__(self, base: Path) -> None:
        self.base = Path(base)
        self.members = self.base / "members"
        self.client = self.base / "client"
        self.root_password_file = self.base / "root-password"

    @property
    def ready(self) -> bool:
        return (self.client / "password").exists() and (self.members / "member.pem").exists()

    def make(self, names: Sequence[str] = ()) -> EtcdPki:
        """Write a new CA's certificates and new passwords (unless they are there already).
        The member certificate is for localhost, 127.0.0.1 and the DNS `names` given."""
        if self.ready:
            return self
        private_dir(self.base, "etcd credentials")
        private_dir(self.members, "etcd member credentials")
        private_dir(self.client, "etcd client credentials")
        now = dt.datetime.now(dt.UTC)
        ca_key = new_key()
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshlm local etcd CA")])
        ca = (
            _builder(ca_name, ca_name, ca_key, now)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        member_key, client_key = new_key(), new_key()
        sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        sans += [x509.DNSName(n) for n in names]
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        member = (
            _builder(_cn("meshlm-etcd-member"), ca_name, member_key, now)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        # No CN: etcd's HTTP gateway refuses a client certificate with one (a CN would name
        # an etcd user on its gRPC port; here a login is by password).
        org = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshlm etcd client")])
        client = (
            _builder(org, ca_name, client_key, now)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)
            .sign(ca_key, hashes.SHA256())
        )
        for d in (self.members, self.client):
            write_private(d / "ca.pem", pem(ca).encode(), "etcd CA")
        write_private(self.members / "member.pem", pem(member).encode(), "etcd member cert")
        write_private(self.members / "member-key.pem", key_pem(member_key), "etcd member key")
        write_private(self.client / "client.pem", pem(client).encode(), "etcd client cert")
        write_private(self.client / "client-key.pem", key_pem(client_key), "etcd client key")
        write_private(self.client / "user", USER.encode(), "etcd user")
        write_private(self.root_password_file, _password(), "etcd root password")
        write_private(self.client / "password", _password(), "etcd password")  # last: ready
        return self

    def password(self) -> str:
        return (self.client / "password").read_text().strip()

    def root_password(self) -> str:
        return self.root_password_file.read_text().strip()

    def member_args(self) -> list[str]:
        """etcd flags: TLS with client certificates of this CA, for clients and peers."""
        ca, cert, key = (str(self.members / f) for f in ("ca.pem", "member.pem", "member-key.pem"))
        return ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca,
                "--client-cert-auth", "--peer-cert-file", cert, "--peer-key-file", key,
                "--peer-trusted-ca-file", ca, "--peer-client-cert-auth"]  # fmt: skip


def _cn(name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])


def _builder(subject: x509.Name, issuer: x509.Name, key, now: dt.datetime):
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + LIFETIME)
    )


def _password() -> bytes:
    return secrets.token_urlsafe(24).encode()

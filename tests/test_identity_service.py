"""The mesh CA's signing service over real gRPC and TLS on loopback (issue 14): the identity
signed is the credential's (join token or client certificate), never the request's; replayed,
expired and foreign credentials are refused and logged without token or key bytes."""

from __future__ import annotations

import json
import logging
import ssl
import time
import urllib.request

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from meshlm.cli import main as meshlm
from tests.test_identity_support import identity_mesh, mode
from xds_server.admin.api import AdminServer
from xds_server.compose import build_server
from xds_server.identity.ca import CA_SERVER_NAME, MeshCA, key_pem, new_key, uri_sans
from xds_server.identity.workload import METHOD, SERVICE
from xds_server.server import XdsServer

PATH = f"/{SERVICE}/{METHOD}"
CALLER = "spiffe://meshlm.local/ns/default/sa/caller"


def _csr(identity: str | None):
    key = new_key()
    b = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    if identity:
        b = b.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(identity)]), True
        )
    pem = b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode()
    return key, pem


def _call(address: str, creds: grpc.ChannelCredentials, body: dict, token: str | None = None):
    options = [("grpc.ssl_target_name_override", CA_SERVER_NAME)]
    metadata = [("authorization", f"Bearer {token}")] if token else []
    with grpc.secure_channel(address, creds, options=options) as ch:
        reply = ch.unary_unary(PATH)(json.dumps(body).encode(), timeout=10, metadata=metadata)
    return json.loads(reply)


def _issue(cp: XdsServer, sa: str = "default/caller", ttl: str = "1h") -> str:
    body = json.dumps({"service_account": sa, "ttl": ttl}).encode()
    status, doc = cp.identity.handle("POST", "/identity/tokens", body)
    assert status == 200, doc
    return doc["token"]


@pytest.fixture(scope="module")
def cp():
    with build_server(identity_mesh("127.0.0.1:1")) as cp:
        yield cp


def _tls(cp: XdsServer) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=cp.identity.ca.bundle_pem())


def _code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details() or ""


def test_join_token_gives_its_service_account_once_and_a_replay_is_refused(cp, caplog) -> None:
    caplog.set_level(logging.INFO, logger="meshlm.identity")
    token = _issue(cp)
    _, csr = _csr(CALLER)
    reply = _call(cp.identity.ca_address, _tls(cp), {"csr": csr}, token)
    leaf = x509.load_pem_x509_certificate(reply["cert_chain"][0].encode())
    assert uri_sans(leaf) == [CALLER] and reply["spiffe_id"] == CALLER
    _, csr2 = _csr(CALLER)
    code, details = _code(lambda: _call(cp.identity.ca_address, _tls(cp), {"csr": csr2}, token))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "replay" in details
    assert "replay" in caplog.text and token not in caplog.text


def test_csr_for_another_service_account_is_refused_and_the_token_kept(cp, caplog) -> None:
    caplog.set_level(logging.INFO, logger="meshlm.identity")
    token = _issue(cp)
    for asked in (
        "spiffe://meshlm.local/ns/default/sa/llm",
        "spiffe://other.td/ns/default/sa/caller",
    ):
        _, csr = _csr(asked)
        code, details = _code(
            lambda csr=csr: _call(cp.identity.ca_address, _tls(cp), {"csr": csr}, token)
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED and asked in details
    assert "refused" in caplog.text
    assert token not in caplog.text
    _, csr = _csr(None)  # no SAN asked: the token's identity is given; the token still works
    assert _call(cp.identity.ca_address, _tls(cp), {"csr": csr}, token)["spiffe_id"] == CALLER


def test_expired_unknown_and_missing_tokens_are_refused(cp) -> None:
    token = _issue(cp, ttl="200ms")
    time.sleep(0.3)
    _, csr = _csr(CALLER)
    code, details = _code(lambda: _call(cp.identity.ca_address, _tls(cp), {"csr": csr}, token))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "expired" in details
    code, details = _code(lambda: _call(cp.identity.ca_address, _tls(cp), {"csr": csr}, "mjt1.x"))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "unknown" in details
    code, _ = _code(lambda: _call(cp.identity.ca_address, _tls(cp), {"csr": csr}))
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_renewal_by_client_certificate_and_a_rogue_cas_certificate_is_refused(cp) -> None:
    token = _issue(cp)
    key, csr = _csr(CALLER)
    chain = "".join(_call(cp.identity.ca_address, _tls(cp), {"csr": csr}, token)["cert_chain"])
    mine = grpc.ssl_channel_credentials(cp.identity.ca.bundle_pem(), key_pem(key), chain.encode())
    _, csr2 = _csr(CALLER)
    assert _call(cp.identity.ca_mtls_address, mine, {"csr": csr2})["spiffe_id"] == CALLER
    _, other = _csr("spiffe://meshlm.local/ns/default/sa/llm")  # renewal cannot change identity
    code, _ = _code(lambda: _call(cp.identity.ca_mtls_address, mine, {"csr": other}))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    rogue = MeshCA()  # same trust domain, another root
    rkey, rcsr = _csr(CALLER)
    rchain = "".join(rogue.sign(x509.load_pem_x509_csr(rcsr.encode()), CALLER, 600))
    theirs = grpc.ssl_channel_credentials(
        cp.identity.ca.bundle_pem(), key_pem(rkey), rchain.encode()
    )
    code, _ = _code(lambda: _call(cp.identity.ca_mtls_address, theirs, {"csr": csr2}))
    assert code == grpc.StatusCode.UNAVAILABLE  # the TLS handshake fails
    code, _ = _code(lambda: _call(cp.identity.ca_address, theirs, {"csr": csr2}))
    assert (
        code == grpc.StatusCode.UNAUTHENTICATED
    )  # no client certificate asked there: no credential


def test_plaintext_and_bad_requests_are_refused_naming_the_field(cp) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{cp.grpc_port}") as ch:
        code, details = _code(lambda: ch.unary_unary(PATH)(b"{}", timeout=10))
    assert code == grpc.StatusCode.UNAVAILABLE, details  # the ADS port takes mTLS only
    token = _issue(cp)
    for body, field in (
        ({"csr": 1}, "request.csr"),
        ({"csr": "x", "ttl": 1}, "request.ttl"),
        ({"csr": _csr(CALLER)[1], "validity_duration": 1}, "validity_duration"),
    ):
        code, details = _code(
            lambda body=body: _call(cp.identity.ca_address, _tls(cp), body, token)
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details
    _, csr = _csr(CALLER)  # bad input used no token up
    assert _call(cp.identity.ca_address, _tls(cp), {"csr": csr}, token)["spiffe_id"] == CALLER


def test_tokens_need_the_admin_token_and_the_cli_writes_a_0600_file(cp, tmp_path) -> None:
    admin = AdminServer(cp, token="admin-secret-1").start()  # HTTPS: the mesh has identity
    roots = tmp_path / "roots.pem"
    roots.write_bytes(cp.identity.ca.bundle_pem())
    tls = ssl.create_default_context(cafile=str(roots))
    try:
        req = urllib.request.Request(
            f"{admin.url}/identity/tokens", data=b'{"service_account": "default/x"}', method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10, context=tls)
        assert e.value.code == 401
        admin_token = tmp_path / "admin.token"
        admin_token.write_text("admin-secret-1\n")
        out = tmp_path / "join.json"
        args = [
            "identity",
            "token",
            "--admin",
            admin.url,
            "--token-file",
            str(admin_token),
            "--cacert",
            str(roots),
            "--service-account",
            "default/caller",
            "--out",
            str(out),
        ]
        assert meshlm(args) == 0
        assert mode(out) == 0o600
        doc = json.loads(out.read_text())
        assert doc["ca"]["root_sha256"] == cp.identity.ca.pins()
        with urllib.request.urlopen(f"{admin.url}/identity", timeout=10, context=tls) as r:
            status = r.read().decode()
        assert doc["token"] not in status and json.loads(status)["join_tokens"]["unused"] >= 1
        bad = [*args[:-4], "--service-account", "caller", "--out", str(out)]
        assert meshlm(bad) == 1
    finally:
        admin.stop()


def test_sidecar_identity_flags_need_identity(capsys) -> None:
    args = ["sidecar", "--xds", "127.0.0.1:1", "--outbound-port", "1", "--join-token-file", "t"]
    assert meshlm(args) == 2
    assert "need --identity" in capsys.readouterr().err

"""The mesh CA and the mesh file's identity block (issue 14), in process."""

from __future__ import annotations

import datetime as dt

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.verification import PolicyBuilder, Store

from tests.test_identity_support import mode
from xds_server.identity.ca import CaError, MeshCA, NotGranted, key_pem, new_key, pem, uri_sans
from xds_server.identity.workload import JoinTokens, Refused
from xds_server.mesh import MeshError, parse_mesh

CALLER = "spiffe://meshlm.local/ns/default/sa/caller"


def _mesh(**top):
    svc = {"versions": {"v1": {"endpoints": ["127.0.0.1:1"]}}, "route": {"weights": {"v1": 100}}}
    return parse_mesh({"services": {"llm": {**svc, **top.pop("svc", {})}}, **top})


def _csr(*names: x509.GeneralName) -> x509.CertificateSigningRequest:
    b = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    if names:
        b = b.add_extension(x509.SubjectAlternativeName(list(names)), True)
    return b.sign(new_key(), hashes.SHA256())


@pytest.mark.parametrize(
    ("identity", "svc", "field"),
    [
        ({"trust_domain": "Mesh.Local"}, {}, "identity.trust_domain"),
        ({"cert_ttl": "5s"}, {}, "identity.cert_ttl"),
        ({"cert_ttl": "2d"}, {}, "identity.cert_ttl"),
        ({"root": {"cert_file": "a.pem"}}, {}, "identity.root.key_file"),
        ({"roots": {}}, {}, "identity.roots"),
        ({}, {"service_account": "llm"}, "services.llm.service_account"),
    ],
)
def test_identity_block_errors_name_the_field(identity, svc, field) -> None:
    with pytest.raises(MeshError, match=f"^{field}: "):
        _mesh(identity=identity, svc=svc)


def test_defaults() -> None:
    mesh = _mesh(identity={})
    assert (mesh.identity.trust_domain, mesh.identity.cert_ttl) == ("meshlm.local", 900.0)
    assert mesh.services["llm"].service_account == "default/llm"
    assert _mesh().identity is None  # no identity block: no CA (opt-in for now)


def test_leaf_is_a_spiffe_workload_certificate_and_other_names_are_not_granted() -> None:
    ca = MeshCA(cert_ttl=600)
    leaf = x509.load_pem_x509_certificate(
        ca.sign(_csr(x509.UniformResourceIdentifier(CALLER)), CALLER, 60)[0].encode()
    )
    assert uri_sans(leaf) == [CALLER]
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    life = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert dt.timedelta(seconds=60) <= life <= dt.timedelta(seconds=95)  # backdated 30 s
    for asked in (x509.DNSName("meshlm-ca"), x509.UniformResourceIdentifier(CALLER + "x")):
        with pytest.raises(NotGranted):
            ca.sign(_csr(asked), CALLER, 60)


def test_intermediate_of_a_user_root(tmp_path) -> None:
    root_ca = MeshCA()  # stands in for the user's root: a CA certificate and its key
    root = root_ca.trust_bundle()[0]
    (tmp_path / "root.pem").write_text(pem(root))
    (tmp_path / "root.key").write_bytes(key_pem(root_ca._roots[0].key))
    ca = MeshCA(root_files=(str(tmp_path / "root.pem"), str(tmp_path / "root.key")))
    chain = [x509.load_pem_x509_certificate(c.encode()) for c in ca.sign(_csr(), CALLER, 60)]
    assert len(chain) == 2 and ca.trust_bundle() == [root]
    verifier = PolicyBuilder().store(Store([root])).build_client_verifier()
    assert verifier.verify(chain[0], chain[1:]).subjects == [x509.UniformResourceIdentifier(CALLER)]
    with pytest.raises(CaError, match=r"^identity\.root\.key_file: not the key"):
        (tmp_path / "other.key").write_bytes(key_pem(new_key()))
        MeshCA(root_files=(str(tmp_path / "root.pem"), str(tmp_path / "other.key")))
    with pytest.raises(CaError, match=r"^identity\.root\.cert_file: "):
        MeshCA(root_files=(str(tmp_path / "missing.pem"), str(tmp_path / "root.key")))


def test_root_is_kept_private_and_rotation_prepares_activates_retires(tmp_path) -> None:
    now = [1_000_000.0]
    state = tmp_path / "ca"
    ca = MeshCA(cert_ttl=600, state_dir=state, clock=lambda: now[0])
    old = ca.trust_bundle()
    assert mode(state) == 0o700 and mode(state / "ca.json") == 0o600
    assert MeshCA(cert_ttl=600, state_dir=state, clock=lambda: now[0]).trust_bundle() == old
    ca.rotate_root()
    bundle = ca.trust_bundle()
    assert len(bundle) == 2 and bundle[0] == old[0]  # prepared: trusted, not signing yet

    def issuer() -> x509.Name:
        leaf = ca.sign(_csr(), CALLER, 60)[0].encode()
        return x509.load_pem_x509_certificate(leaf).issuer

    assert issuer() == old[0].subject
    now[0] += 601  # one cert_ttl later: the new root signs, the old one is still trusted
    assert issuer() == bundle[1].subject and len(ca.trust_bundle()) == 2
    now[0] += 600  # another cert_ttl: every certificate of the old root expired; it retires
    assert ca.trust_bundle() == [bundle[1]]
    reloaded = MeshCA(cert_ttl=600, state_dir=state, clock=lambda: now[0])
    assert reloaded.trust_bundle() == [bundle[1]]


def test_join_tokens_are_kept_as_hashes_single_use_and_expire(tmp_path) -> None:
    now = [100.0]
    path = tmp_path / "t" / "join_tokens.json"
    path.parent.mkdir(mode=0o700)
    tokens = JoinTokens(path, clock=lambda: now[0])
    token, _ = tokens.issue("default/caller", 60)
    assert token not in path.read_text() and mode(path) == 0o600
    assert JoinTokens(path, clock=lambda: now[0]).check(token) == "default/caller"
    assert tokens.check(token, redeem=True) == "default/caller"
    with pytest.raises(Refused, match="replay"):
        JoinTokens(path, clock=lambda: now[0]).check(token)  # used up across restarts too
    late, _ = tokens.issue("default/caller", 60)
    now[0] += 61
    with pytest.raises(Refused, match="expired"):
        tokens.check(late)
    with pytest.raises(ValueError, match=r"^service_account: "):
        tokens.issue("caller", 60)


def test_serving_chain_ends_with_the_root() -> None:
    ca = MeshCA()
    _, chain, _ = ca.serving_credentials()
    certs = x509.load_pem_x509_certificates(chain)
    assert certs[-1] == ca.trust_bundle()[0]
    names = certs[0].extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["meshlm-ca"]

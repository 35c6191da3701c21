"""The mesh file's `identity:` section: the SPIFFE trust domain, workload certificates' lifetime,
the CA root's files and the mTLS mode; and the shape of a service account."""

from __future__ import annotations

import re

from xds_server.mesh.fields import MeshError, only_known, parse_duration, read_mapping
from xds_server.mesh.model import MTLS_MODES, Identity

# A SPIFFE trust domain (lower case) and the path segments of a service account.
TRUST_DOMAIN = re.compile(r"^[a-z0-9][a-z0-9._-]*\Z")


SERVICE_ACCOUNT = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*/[a-zA-Z0-9][a-zA-Z0-9_.-]*\Z")


# Workload certificates live 10 s (tests) to a day; 15 minutes by default (Istio: 24 h).
CERT_TTL_RANGE = (10.0, 86400.0)


def parse_identity(d: dict) -> Identity:
    """`identity: {trust_domain, cert_ttl, root: {cert_file, key_file}, mtls}`, all optional."""
    only_known(d, "identity", {"trust_domain", "cert_ttl", "root", "mtls"})
    td = d.get("trust_domain", "meshlm.local")
    if not isinstance(td, str) or not TRUST_DOMAIN.match(td) or len(td) > 255:
        raise MeshError(
            f"identity.trust_domain: expected lower-case letters, digits, . _ - (a SPIFFE trust "
            f"domain), got {td!r}"
        )
    ttl = parse_duration(d.get("cert_ttl", "15m"), "identity.cert_ttl")
    lo, hi = CERT_TTL_RANGE
    if not lo <= ttl <= hi:
        raise MeshError(f"identity.cert_ttl: must be {lo:g}s to {hi / 3600:g}h, got {ttl:g}s")
    root = read_mapping(d.get("root"), "identity.root")
    only_known(root, "identity.root", {"cert_file", "key_file"})
    for key in ("cert_file", "key_file"):
        value = root.get(key)
        if root and (not isinstance(value, str) or not value):
            raise MeshError(f"identity.root.{key}: expected a file path, got {value!r}")
    mtls = d.get("mtls", "strict")
    if mtls is False:  # YAML 1.1 reads a bare `off` as false
        mtls = "off"
    if not isinstance(mtls, str) or mtls not in MTLS_MODES:
        raise MeshError(f"identity.mtls: expected one of {', '.join(MTLS_MODES)}, got {mtls!r}")
    return Identity(
        trust_domain=td,
        cert_ttl=ttl,
        root_cert_file=root.get("cert_file"),
        root_key_file=root.get("key_file"),
        mtls=mtls,
    )

"""Helpers for the identity tests (issue 14): a mesh with an `identity` block, join token files,
a supervised sidecar with an identity agent, a TLS listener that takes its certificate by SDS, a
TLS client that reports the peer's certificate. No tests here."""

from __future__ import annotations

import http.client
import json
import os
import ssl
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509

from mesh_common.ports import free_port
from mesh_common.private_files import write_private
from mesh_common.sds_names import DEFAULT, ROOTCA
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from sidecar.identity import IdentityAgent
from sidecar.lkg import LastKnownGood
from sidecar.sds import secret_ref
from sidecar.supervisor import Supervisor
from xds_server.identity.ca import uri_sans
from xds_server.mesh import Mesh, parse_mesh
from xds_server.server import XdsServer

_HCM = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_TLS = "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"


def identity_mesh(upstream: str, **identity: Any) -> Mesh:
    return parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {"v1": {"endpoints": [upstream]}},
                    "route": {"weights": {"v1": 100}},
                }
            },
            "identity": identity,
        }
    )


def short_dir() -> Path:
    """A private dir with a short path: a unix socket path holds 107 bytes."""
    return Path(tempfile.mkdtemp(prefix="m1-"))


def join_token_file(cp: XdsServer, service_account: str, where: Path, ttl: str = "1h") -> Path:
    """A join token file as `meshlm identity token` writes it (0600)."""
    body = json.dumps({"service_account": service_account, "ttl": ttl}).encode()
    status, doc = cp.identity.handle("POST", "/identity/tokens", body)
    assert status == 200, doc
    path = where / f"token-{service_account.replace('/', '-')}.json"
    write_private(path, json.dumps(doc).encode(), "a join token")
    return path


@dataclass
class Sidecar:
    """A supervised Envoy that only the control plane configures, with its identity agent."""

    sv: Supervisor
    agent: IdentityAgent
    events: list[str] = field(default_factory=list)  # the agent's and the supervisor's

    @property
    def envoy(self) -> EnvoyProcess:  # the current one (a supervisor may restart it)
        assert self.sv.envoy is not None
        return self.sv.envoy

    def stat(self, name: str) -> int:
        return self.envoy.stats().get(name, 0)


def identity_sidecar(
    cp: XdsServer,
    where: Path,
    node: str,
    token: Path | None,
    lkg: LastKnownGood | None = None,
    **bootstrap: Any,
) -> Sidecar:
    """`meshlm sidecar --identity` in-process, not started: an agent in `where/node` enrolling
    with `token` (None: it boots from the certificate persisted there) and a supervisor whose
    Envoy reaches `cp` over ADS; `bootstrap`: ads_bootstrap's listener arguments."""
    events: list[str] = []
    agent = IdentityAgent(where / node, join_token_file=token, on_event=events.append)
    boot = ads_bootstrap(
        node, xds_address=("127.0.0.1", cp.grpc_port), admin_port=free_port(), **bootstrap
    )
    sv = Supervisor(
        node, boot, ("127.0.0.1", cp.grpc_port), lkg=lkg, poll_interval=0.2, identity=agent,
        on_event=events.append,
    )  # fmt: skip
    return Sidecar(sv, agent, events)


def tls_listener(port: int) -> dict[str, Any]:
    """A static listener whose TLS certificate and trust bundle come from the sidecar's agent by
    SDS (secrets `default` and `ROOTCA`); it answers every request 200 "ok"."""
    return {
        "name": "tls_test",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [
            {
                "transport_socket": {
                    "name": "envoy.transport_sockets.tls",
                    "typed_config": {
                        "@type": f"type.googleapis.com/{_TLS}",
                        "common_tls_context": {
                            "tls_certificate_sds_secret_configs": [secret_ref(DEFAULT)],
                            "validation_context_sds_secret_config": secret_ref(ROOTCA),
                        },
                    },
                },
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": f"type.googleapis.com/{_HCM}",
                            "stat_prefix": "tls_test",
                            "route_config": {
                                "virtual_hosts": [
                                    {
                                        "name": "all",
                                        "domains": ["*"],
                                        "routes": [
                                            {
                                                "match": {"prefix": "/"},
                                                "direct_response": {
                                                    "status": 200,
                                                    "body": {"inline_string": "ok"},
                                                },
                                            }
                                        ],
                                    }
                                ]
                            },
                            "http_filters": [
                                {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/"
                                        "envoy.extensions.filters.http.router.v3.Router"
                                    },
                                }
                            ],
                        },
                    }
                ],
            }
        ],
    }


def tls_get(port: int, roots_pem: str) -> tuple[int, x509.Certificate]:
    """GET / over a new TLS connection that verifies the server against `roots_pem` (no host
    name: a workload certificate names a SPIFFE ID, not a host); (status, server certificate)."""
    ctx = ssl.create_default_context(cadata=roots_pem)
    ctx.check_hostname = False
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=5)
    try:
        conn.request("GET", "/")
        status = conn.getresponse().status
        der = conn.sock.getpeercert(binary_form=True)
    finally:
        conn.close()
    return status, x509.load_der_x509_certificate(der)


def san(cert: x509.Certificate) -> list[str]:
    return uri_sans(cert)


def mode(path: str | Path) -> int:
    return os.stat(path).st_mode & 0o777

"""mTLS on every hop caller sidecar -> inbound sidecar (issue 14, items 2 and 4), on real Envoys
whose identity agents got their SPIFFE certificates from the control plane's mesh CA: the
caller proves the replica's exact SPIFFE ID, the inbound listener requires a client certificate
of the trust domain; a plaintext client, a rogue CA, another trust domain, an expired or a not
yet valid certificate are refused in the handshake; renewals under load lose no call; a sidecar
restarted while the control plane is down serves mTLS from its last-known-good config and its
persisted certificate, with no private key in that file or in Envoy's config dump."""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import os
import shutil
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from envoy.extensions.access_loggers.stream.v3.stream_pb2 import StdoutAccessLog
from grpc_health.v1 import health_pb2

from mesh_common import type_urls as t
from mesh_common.ports import free_port
from sidecar.bootstrap import with_sds
from sidecar.envoy_process import EnvoyProcess
from sidecar.identity import IdentityAgent
from sidecar.lkg import LastKnownGood
from tests.test_admin_token import Xds
from tests.test_cli_errors import meshlm
from tests.test_identity_support import (
    Sidecar,
    identity_sidecar,
    join_token_file,
    short_dir,
    tls_listener,
)
from tests.test_lb_least_loaded import OrcaReplica
from tests.test_mesh_support import json_lines
from tests.test_xds_support import METHOD, CallLoop, eventually
from xds_server.compose import build_server
from xds_server.identity.ca import MeshCA, key_pem, uri_sans
from xds_server.mesh import parse_mesh
from xds_server.resources.build import ResourceError, build_resources
from xds_server.resources.listeners import HCM
from xds_server.server import XdsServer
from xds_server.xds.node import NodeInfo

TD = "meshlm.local"
LLM_ID = f"spiffe://{TD}/ns/default/sa/llm"
CALLER_ID = f"spiffe://{TD}/ns/default/sa/caller"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
CERT_TTL = 20.0  # seconds: every agent renews at half-life, 10 s, while the tests run


class Replica(OrcaReplica):
    """A runtime stand-in: answers calls with its name (keeping the last call's metadata),
    streams ORCA load reports (least_loaded) and answers gRPC health checks SERVING, so the
    caller's probes and ORCA streams cross the mTLS hop too."""

    def __init__(self, name: str, utilization: float) -> None:
        self.seen: dict[str, str] = {}
        super().__init__(name, utilization)

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method == HEALTH_CHECK:
            serving = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
            return grpc.unary_unary_rpc_method_handler(lambda req, ctx: serving.SerializeToString())
        return super().service(details)

    def _who(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.seen = dict(context.invocation_metadata())
        return super()._who(request, context)


def _inbound(cp: XdsServer, d: Path, node: str, sa: str, service: str, port: int, runtime: int):
    token = join_token_file(cp, sa, d)
    return identity_sidecar(
        cp, d, node, token, service=service, version="v1", inbound_port=port,
        local_endpoint=f"127.0.0.1:{runtime}",
    )  # fmt: skip


@dataclass
class Impostor:
    """An Envoy that no control plane configures, at a replica's address, holding a mesh
    certificate of another service account (its own join token's): a TLS listener that answers
    anything 200 "ok"."""

    envoy: EnvoyProcess
    agent: IdentityAgent

    @classmethod
    def start(cls, cp: XdsServer, d: Path, port: int, sa: str) -> Impostor:
        agent = IdentityAgent(d / "impostor", join_token_file=join_token_file(cp, sa, d)).start()
        boot = {
            "node": {"id": "impostor", "cluster": "meshlm"},
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
            "static_resources": {"listeners": [tls_listener(port)]},
        }
        envoy = EnvoyProcess(with_sds(boot, agent.socket_path)).start()
        envoy.wait_ready()
        assert agent.wait_ready(15)
        return cls(envoy, agent)

    def stop(self) -> None:
        self.envoy.stop()
        self.agent.stop()


def _listener_ssl(port: int) -> str:
    return f"listener.127.0.0.1_{port}.ssl."


@dataclass
class Mesh:
    cp: XdsServer
    cp_dir: Path  # the mesh CA's state (its root key), for minting test certificates
    caller: Sidecar
    caller_port: int
    inbound: dict[str, Sidecar]  # service -> its one inbound sidecar
    ports: dict[str, int]  # service -> inbound listener port
    llm: Replica
    impostor: Impostor  # at the address of service `bad`'s one replica
    access_log: Path  # every sidecar's, one JSON line per call

    def inbound_lines(self, path: str = METHOD) -> list[dict]:
        """The inbound sidecar's access log lines of calls to `path`, oldest first."""
        text = self.access_log.read_text() if self.access_log.exists() else ""
        lines = json_lines(text)
        return [x for x in lines if x["listener"] == "inbound|llm|v1" and x["path"] == path]

    def call(self, service: str) -> str:
        return call(self.caller_port, service)


def call(caller_port: int, service: str, timeout: float = 5) -> str:
    """One call through the caller sidecar: the name of the upstream that answered."""
    with grpc.insecure_channel(
        f"127.0.0.1:{caller_port}", options=[("grpc.default_authority", service)]
    ) as ch:
        return ch.unary_unary(METHOD)(b"", timeout=timeout).decode()


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    """caller sidecar -> inbound sidecar of `llm` (default/llm, least_loaded, health checks);
    service `bad`'s replica address holds an impostor (default/impostor, not default/bad)."""
    d = short_dir()
    ports = {"llm": free_port(), "bad": free_port()}
    llm, impostor = Replica("llm", 0.5), None
    health = {"interval": "1s", "timeout": "1s", "unhealthy_threshold": 2}
    spec = parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {"v1": {"endpoints": [f"127.0.0.1:{ports['llm']}"]}},
                    "route": {"weights": {"v1": 100}},
                    "load_balancing": "least_loaded",
                    "health_check": health,
                },
                "bad": {
                    "versions": {"v1": {"endpoints": [f"127.0.0.1:{ports['bad']}"]}},
                    "route": {"weights": {"v1": 100}},
                },
            },
            "identity": {"trust_domain": TD, "cert_ttl": f"{CERT_TTL:g}s"},
            "access_log": {"path": str(d / "access.log"), "inbound": "all"},
        }
    )
    cp = build_server(spec, debounce=0.02, identity_dir=str(d / "cp")).start()
    sidecars: list[Sidecar] = []
    try:
        impostor = Impostor.start(cp, d, ports["bad"], "default/impostor")
        inbound = {"llm": _inbound(cp, d, "llm-1", "default/llm", "llm", ports["llm"], llm.port)}
        caller_port = free_port()
        token = join_token_file(cp, "default/caller", d)
        caller = identity_sidecar(cp, d, "caller", token, outbound_port=caller_port)
        sidecars = [*inbound.values(), caller]
        for s in sidecars:
            s.sv.start()
        for s in sidecars:
            s.sv.wait_ready()
            assert s.agent.wait_ready(15), s.events
        eventually(lambda: call(caller_port, "llm") == "llm", 30, "a call through both sidecars")
        yield Mesh(
            cp, d / "cp", caller, caller_port, inbound, ports, llm, impostor, d / "access.log"
        )
    finally:
        for s in sidecars:
            s.sv.stop()
        if impostor:
            impostor.stop()
        cp.stop()
        llm.stop()
        shutil.rmtree(d, ignore_errors=True)


# -- certificates a test mints itself ----------------------------------------------------------


@dataclass
class ClientCert:
    cert: Path | None  # PEM chain; None: no client certificate at all
    key: Path | None
    bundle: str  # the roots the client trusts (the mesh's)


def _csr(key: ec.EllipticCurvePrivateKey) -> x509.CertificateSigningRequest:
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(key, hashes.SHA256())
    )


def _ca_copy(m: Mesh, where: Path) -> Path:
    """A copy of the mesh CA's state (0700 dir, 0600 file): a MeshCA made on it signs with the
    mesh's own root, without touching the control plane's files."""
    if not where.exists():
        shutil.copytree(m.cp_dir, where)
        os.chmod(where, 0o700)
    return where


def _mint(m: Mesh, tmp: Path, case: str) -> ClientCert:
    bundle = m.cp.identity.ca.bundle_pem().decode()
    if case == "no certificate":
        return ClientCert(None, None, bundle)
    mesh_ca = _ca_copy(m, tmp / "ca")
    ca, identity, ttl = MeshCA(TD, state_dir=mesh_ca), CALLER_ID, 600.0
    if case == "another CA":
        ca = MeshCA(TD)  # a root of its own, same trust domain and SPIFFE ID
    elif case == "another trust domain":  # the mesh's own root, a SPIFFE ID of elsewhere
        ca, identity = (
            MeshCA("other.example", state_dir=mesh_ca),
            "spiffe://other.example/ns/a/sa/b",
        )
    elif case == "not yet valid":
        ca = MeshCA(TD, state_dir=mesh_ca, clock=lambda: time.time() + 3600)
    elif case == "expired":
        ttl = 1.0
    key = ec.generate_private_key(ec.SECP256R1())
    chain = ca.sign(_csr(key), identity, ttl)
    leaf = x509.load_pem_x509_certificate(chain[0].encode())
    if case == "expired":  # valid until a second from now: wait it out
        time.sleep(max(0.0, leaf.not_valid_after_utc.timestamp() - time.time() + 1.1))
        assert leaf.not_valid_after_utc < dt.datetime.now(dt.UTC)
    cert, key_file = tmp / f"{case}.pem", tmp / f"{case}.key"
    cert.write_text("".join(chain))
    key_file.write_bytes(key_pem(key))
    return ClientCert(cert, key_file, bundle)


def _tls_request(port: int, client: ClientCert) -> tuple[bytes, x509.Certificate]:
    """An HTTP/1.1 request over a new TLS connection with `client`'s certificate: (the first
    bytes of the answer, the server's certificate). A refused client certificate surfaces as an
    SSLError or a closed connection here (TLS 1.3: the server's alert follows the handshake)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=client.bundle)
    ctx.check_hostname = False  # a workload certificate names a SPIFFE ID, not a host
    if client.cert:
        ctx.load_cert_chain(str(client.cert), str(client.key))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw) as s,
    ):
        server = x509.load_der_x509_certificate(s.getpeercert(binary_form=True))
        s.sendall(b"GET / HTTP/1.1\r\nHost: llm\r\n\r\n")
        return s.recv(64), server


# -- the tests ---------------------------------------------------------------------------------


def test_a_call_between_sidecars_is_mtls_and_probes_and_load_reports_cross_it(mesh: Mesh) -> None:
    assert mesh.call("llm") == "llm"
    inbound, caller = mesh.inbound["llm"], mesh.caller
    assert inbound.stat(_listener_ssl(mesh.ports["llm"]) + "handshake") >= 1
    up = "cluster.outbound|llm|v1."
    assert caller.stat(up + "ssl.handshake") >= 1
    # The caller's active health checks and ORCA out-of-band streams use the same TLS hop.
    # (A probe sent before the inbound listener was up may have failed: count from a success.)
    hc = up + "health_check."
    eventually(lambda: caller.stat(hc + "success") >= 1, 15, "health checks pass")
    failed, passed = caller.stat(hc + "failure"), caller.stat(hc + "success")
    eventually(lambda: caller.stat(hc + "success") >= passed + 2, 15, "more checks pass")
    assert caller.stat(hc + "failure") == failed
    oob = up + "lb_orca_oob."
    eventually(lambda: caller.stat(oob + "reports_received") >= 1, 15, "ORCA reports arrive")
    failed, got = caller.stat(oob + "stream_failures"), caller.stat(oob + "reports_received")
    eventually(lambda: caller.stat(oob + "reports_received") >= got + 2, 15, "more reports")
    assert caller.stat(oob + "stream_failures") == failed
    # Each side holds its own SPIFFE certificate (Envoy's /certs: what it got by SDS).
    for side, spiffe in ((inbound, LLM_ID), (caller, CALLER_ID)):
        certs = json.loads(side.envoy.admin_get("/certs"))["certificates"]
        held = [
            san["uri"] for c in certs for cc in c["cert_chain"] for san in cc["subject_alt_names"]
        ]
        assert spiffe in held, certs


def test_a_plaintext_client_is_refused_by_the_inbound_listener(mesh: Mesh) -> None:
    served = mesh.llm.served
    with (
        grpc.insecure_channel(f"127.0.0.1:{mesh.ports['llm']}") as ch,
        pytest.raises(grpc.RpcError) as e,
    ):
        ch.unary_unary(METHOD)(b"", timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert mesh.llm.served == served
    assert mesh.inbound["llm"].stat(_listener_ssl(mesh.ports["llm"]) + "connection_error") >= 1


# What the inbound listener counts for each client certificate it refuses.
REFUSED = {
    "no certificate": "fail_verify_no_cert",
    "another CA": "fail_verify_error",
    "another trust domain": "fail_verify_san",
    "expired": "fail_verify_error",
    "not yet valid": "fail_verify_error",
}


@pytest.mark.parametrize("case", ["a workload of the mesh", *REFUSED])
def test_the_inbound_listener_takes_only_valid_workload_certificates_of_its_trust_domain(
    mesh: Mesh, tmp_path: Path, case: str
) -> None:
    port = mesh.ports["llm"]
    client = _mint(mesh, tmp_path, case)
    if case not in REFUSED:  # the same client with a good certificate gets an HTTP answer
        answer, server = _tls_request(port, client)
        assert answer.startswith(b"HTTP/1.1 "), answer
        assert uri_sans(server) == [LLM_ID]
        return
    stat = _listener_ssl(port) + REFUSED[case]
    before = mesh.inbound["llm"].stat(stat)
    try:
        answer, _ = _tls_request(port, client)
    except (ssl.SSLError, ConnectionError) as e:
        answer = repr(e).encode()
    assert not answer.startswith(b"HTTP"), answer
    eventually(lambda: mesh.inbound["llm"].stat(stat) > before, 5, stat)


def test_a_replica_holding_another_identity_is_refused_by_the_caller(mesh: Mesh) -> None:
    assert mesh.impostor.agent.spiffe_id == f"spiffe://{TD}/ns/default/sa/impostor"
    refused = "cluster.outbound|bad|v1.ssl.fail_verify_san"
    before = mesh.caller.stat(refused)
    with pytest.raises(grpc.RpcError) as e:
        mesh.call("bad")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert mesh.caller.stat(refused) > before
    assert mesh.impostor.envoy.stats().get("http.tls_test.downstream_rq_total", 0) == 0


def _xfcc(value: str) -> list[dict[str, str]]:
    """An x-forwarded-client-cert value: one dict per element (a proxy hop), key -> value."""
    return [dict(kv.split("=", 1) for kv in element.split(";")) for element in value.split(",")]


def _grpc_over_http1(port: int, client: ClientCert, headers: dict[str, str]) -> bytes:
    """A gRPC call (METHOD, an empty message) as HTTP/1.1 over TLS with `client`'s
    certificate, straight to an inbound listener (Python's gRPC checks a server by host name,
    which a workload certificate has not); the first bytes of the answer."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=client.bundle)
    ctx.check_hostname = False
    ctx.load_cert_chain(str(client.cert), str(client.key))
    head = {"Host": "llm", "content-type": "application/grpc", "te": "trailers",
            "content-length": "5", **headers}  # fmt: skip
    request = f"POST {METHOD} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw) as s,
    ):
        s.sendall(request.encode() + b"\r\n" + b"\0" * 5)
        return s.recv(64)


def test_the_runtime_learns_the_verified_caller_from_xfcc(mesh: Mesh, tmp_path: Path) -> None:
    # Istio's way: the inbound sidecar sets x-forwarded-client-cert from the TLS connection
    # (forward_client_cert_details SANITIZE_SET), whatever the authz mode (none here).
    forged = f"By={LLM_ID};URI=spiffe://{TD}/ns/apps/sa/admin"
    with grpc.insecure_channel(
        f"127.0.0.1:{mesh.caller_port}", options=[("grpc.default_authority", "llm")]
    ) as ch:
        md = (("x-forwarded-client-cert", forged),)
        assert ch.unary_unary(METHOD)(b"", metadata=md, timeout=5) == b"llm"
    (hop,) = _xfcc(mesh.llm.seen["x-forwarded-client-cert"])
    assert (hop["By"], hop["URI"]) == (LLM_ID, CALLER_ID) and len(hop["Hash"]) == 64, hop
    # A workload of the mesh that sends its own XFCC straight to the inbound listener gets it
    # replaced, not appended: the runtime sees only what the handshake proved.
    client = _mint(mesh, tmp_path, "a workload of the mesh")
    answer = _grpc_over_http1(mesh.ports["llm"], client, {"x-forwarded-client-cert": forged})
    assert answer.startswith(b"HTTP/1.1 200"), answer
    (hop,) = _xfcc(mesh.llm.seen["x-forwarded-client-cert"])
    assert (hop["By"], hop["URI"]) == (LLM_ID, CALLER_ID), hop


def test_the_inbound_access_log_names_the_callers_spiffe_id(mesh: Mesh) -> None:
    before = len(mesh.inbound_lines())
    assert mesh.call("llm") == "llm"
    lines = eventually(lambda: mesh.inbound_lines()[before:], 10, "the call's inbound line")
    assert lines[-1]["downstream_peer_uri_san"] == CALLER_ID, lines[-1]


def test_certificate_renewals_under_load_lose_no_call(mesh: Mesh, tmp_path: Path) -> None:
    inbound, caller = mesh.inbound["llm"], mesh.caller
    start = (inbound.agent.renewals, caller.agent.renewals)
    client = _mint(mesh, tmp_path, "a workload of the mesh")
    served: list[int] = []  # the inbound's certificate serial on each new connection
    with CallLoop(mesh.caller_port) as calls:
        deadline = time.monotonic() + CERT_TTL
        while time.monotonic() < deadline and (
            inbound.agent.renewals <= start[0] or caller.agent.renewals <= start[1]
        ):
            served.append(_tls_request(mesh.ports["llm"], client)[1].serial_number)
            time.sleep(0.2)
        served.append(_tls_request(mesh.ports["llm"], client)[1].serial_number)
        time.sleep(0.5)
    assert inbound.agent.renewals > start[0] and caller.agent.renewals > start[1]
    assert calls.failures == [] and calls.served["llm"] >= 10, (calls.failures, calls.served)
    assert len(set(served)) >= 2, "the renewed certificate serves new connections"


def test_a_sidecar_restarted_while_the_control_plane_is_down_serves_mtls_from_lkg() -> None:
    d = short_dir()
    inbound_port, caller_port = free_port(), free_port()
    replica = Replica("llm", 0.5)
    spec = parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {"v1": {"endpoints": [f"127.0.0.1:{inbound_port}"]}},
                    "route": {"weights": {"v1": 100}},
                }
            },
            "identity": {"trust_domain": TD},
        }
    )
    lkg = LastKnownGood(d / "lkg.json")
    kw = {"service": "llm", "version": "v1", "inbound_port": inbound_port,
          "local_endpoint": f"127.0.0.1:{replica.port}"}  # fmt: skip
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, d, True)
        stack.callback(replica.stop)
        cp = stack.enter_context(build_server(spec, debounce=0.02, identity_dir=str(d / "cp")))
        caller = identity_sidecar(cp, d, "caller", join_token_file(cp, "default/caller", d),
                                  outbound_port=caller_port)  # fmt: skip
        inbound = identity_sidecar(cp, d, "llm-1", join_token_file(cp, "default/llm", d), lkg, **kw)
        for s in (caller, inbound):
            stack.callback(s.sv.stop)
            s.sv.start()
        eventually(lambda: call(caller_port, "llm") == "llm", 30, "a call through both sidecars")
        serial = inbound.agent.current.serial
        key = inbound.agent.current.key_pem
        eventually(lambda: inbound.sv.saved_at, 15, "last-known-good saved")
        inbound.sv.stop()
        cp.stop()
        # The control plane is gone; a new supervisor (same private dir, same cache) boots
        # Envoy from the last-known-good config, its agent serving the persisted certificate.
        again = identity_sidecar(cp, d, "llm-1", None, lkg, **kw)
        stack.callback(again.sv.stop)
        again.sv.start()
        again.sv.wait_ready()
        assert again.sv.mode == "lkg" and again.agent.current.serial == serial
        before = replica.served
        eventually(lambda: call(caller_port, "llm") == "llm", 20, "a call to the restarted sidecar")
        assert replica.served > before
        assert again.stat(_listener_ssl(inbound_port) + "handshake") >= 1
        dump = again.envoy.config_dump_eds()
        lkg_text = (d / "lkg.json").read_text()
    secrets = [
        s["secret"]["tls_certificate"]["private_key"]
        for c in dump["configs"]
        if c["@type"].endswith(".SecretsConfigDump")
        for s in c.get("dynamic_active_secrets", [])
        if "tls_certificate" in s["secret"]
    ]
    assert secrets and all(base64.b64decode(k["inline_bytes"]) == b"[redacted]" for k in secrets)
    der = "".join(key.strip().splitlines()[1:-1])  # the key's base64 body
    for where, text in (("config_dump", json.dumps(dump)), ("lkg", lkg_text)):
        assert der[:40] not in text and base64.b64encode(key.encode()).decode()[:60] not in text
        assert "PRIVATE KEY" not in text, where


# -- the mesh file's side ----------------------------------------------------------------------


def _raw_one_service(endpoint: str = "127.0.0.1:9") -> dict:
    return {
        "services": {
            "llm": {
                "versions": {"v1": {"endpoints": [endpoint]}},
                "route": {"weights": {"v1": 100}},
            }
        }
    }


def _one_service(identity: dict | None, endpoint: str = "127.0.0.1:9"):
    raw = _raw_one_service(endpoint)
    return parse_mesh({**raw, "identity": identity} if identity is not None else raw)


def _tls_where(mesh, node: NodeInfo) -> dict[str, bool]:
    """ "cluster NAME" / "listener NAME" -> whether it has a TLS transport socket."""
    res = build_resources(mesh, node)
    out = {f"cluster {n}": c.HasField("transport_socket") for n, c in res[t.CLUSTER].items()}
    for n, lis in res[t.LISTENER].items():
        out[f"listener {n}"] = all(fc.HasField("transport_socket") for fc in lis.filter_chains)
    return out


def test_mtls_off_keeps_hops_plaintext_and_strict_refuses_a_runtime_off_loopback() -> None:
    inbound = NodeInfo(service="llm", version="v1", inbound_port=9000, local_endpoint="10.0.0.5:7")
    local = NodeInfo(service="llm", version="v1", inbound_port=9000, local_endpoint="127.0.0.1:7")
    caller = NodeInfo(outbound_port=9001)
    off = _one_service({"mtls": False})  # what YAML makes of a bare `mtls: off`
    assert not any(_tls_where(off, inbound).values())
    assert not any(_tls_where(off, caller).values())
    assert not any(_tls_where(_one_service(None), caller).values())
    strict = _one_service({})
    assert _tls_where(strict, caller) == {
        "cluster outbound|llm|v1": True,
        "listener outbound": False,
    }
    # The inbound listener is mTLS; its clusters (the hop to the runtime on loopback) are not.
    assert _tls_where(strict, local) == {
        "cluster inbound|llm|v1": False,
        "cluster inbound|llm|v1|orca": False,
        "listener inbound|llm|v1": True,
    }
    with pytest.raises(ResourceError) as e:
        build_resources(strict, inbound)
    assert "meshlm.local_endpoint" in str(e.value) and "10.0.0.5:7" in str(e.value)
    assert "identity.mtls: off" in str(e.value)


def _inbound_hcm(mesh) -> HCM:
    node = NodeInfo(service="llm", version="v1", inbound_port=9000, local_endpoint="127.0.0.1:7")
    (lis,) = build_resources(mesh, node)[t.LISTENER].values()
    hcm = HCM()
    lis.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return hcm


def test_only_an_mtls_inbound_listener_forwards_and_logs_the_callers_identity() -> None:
    logged = {"access_log": {"inbound": "all"}}
    strict = _inbound_hcm(parse_mesh({**_raw_one_service(), **logged, "identity": {}}))
    assert strict.forward_client_cert_details == HCM.SANITIZE_SET
    assert strict.set_current_client_cert_details.uri
    assert _log_fields(strict)["downstream_peer_uri_san"] == "%DOWNSTREAM_PEER_URI_SAN%"
    for plain in ({}, {"identity": {"mtls": False}}):  # no certificate to forward or log
        hcm = _inbound_hcm(parse_mesh({**_raw_one_service(), **logged, **plain}))
        assert hcm.forward_client_cert_details == HCM.SANITIZE  # a client's XFCC dropped
        assert not hcm.HasField("set_current_client_cert_details")
        assert "downstream_peer_uri_san" not in _log_fields(hcm)


def _log_fields(hcm: HCM) -> dict:
    (log,) = hcm.access_log
    out = StdoutAccessLog()
    log.typed_config.Unpack(out)
    return dict(out.log_format.json_format)


def test_the_control_plane_warns_at_load_of_a_mesh_without_identity(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    (tmp_path / "run").mkdir(mode=0o700)
    xds = Xds(tmp_path, free_port(), free_port(), env=env)
    try:
        xds.wait_up()
    finally:
        xds.stop()
    out = xds.output()
    warned = [line for line in out.splitlines() if "no `identity:` block" in line]
    assert len(warned) == 1 and "warning" in warned[0] and "plaintext" in warned[0], out


def test_meshlm_serve_warns_of_a_runtime_reachable_around_its_sidecar() -> None:
    # A port in use on every address: each run stops at its listen check, before the model.
    with socket.create_server(("0.0.0.0", 0)) as s:
        port = str(s.getsockname()[1])
        wide = meshlm("serve", "--host", "0.0.0.0", "--port", port)
        local = meshlm("serve", "--port", port)
    assert wide.returncode == local.returncode == 1, (wide.stderr, local.stderr)
    warning = "--host 0.0.0.0: the runtime takes plaintext calls from any host that reaches it"
    assert warning in wide.stderr and "plaintext" not in local.stderr, (wide.stderr, local.stderr)

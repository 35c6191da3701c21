"""Authorization by workload identity on real Envoys (issue 14, item 3): caller sidecars holding
SPIFFE certificates from the mesh CA call one inbound sidecar over mTLS with the same valid API
key; the service's `callers` decide by the caller's certificate (Envoy RBAC first, then the Wasm
authz filter) and the runtime learns the verified caller from `x-meshlm-principal`."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from mesh_common.ports import free_port
from tests.test_identity_support import Sidecar, identity_sidecar, join_token_file, short_dir
from tests.test_xds_support import eventually
from tests.testbed import EchoGrpcUpstream
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.server import XdsServer

TD = "meshlm.local"
GENERATE = "/meshlm.inference.v1.Inference/Generate"
INFO = "/meshlm.inference.v1.Inference/Info"
KEY = "acme-key"
CHAT_ID = f"spiffe://{TD}/ns/apps/sa/chat"
INBOUND = "http.inbound_llm_v1."


def mesh_doc(runtime_port: int, inbound_port: int, callers: list) -> dict:
    return {
        "services": {
            "llm": {
                "versions": {"v1": {"endpoints": [f"127.0.0.1:{inbound_port}"]}},
                "callers": callers,
            }
        },
        "tenants": {"acme": {"key_sha256": hash_key(KEY), "allow": ["llm/*"]}},
        "identity": {"trust_domain": TD},
    }


CALLERS = [{"service_account": "apps/chat", "methods": ["Generate"]}]


@dataclass
class Mesh:
    cp: XdsServer
    inbound: Sidecar
    callers: dict[str, int]  # service account -> its caller sidecar's outbound port
    runtime_port: int
    inbound_port: int

    def call(self, caller: str, method: str = GENERATE, key: str = KEY) -> tuple[str, dict]:
        """(gRPC status name, the metadata the runtime saw) of one call through `caller`."""
        with grpc.insecure_channel(
            f"127.0.0.1:{self.callers[caller]}", options=[("grpc.default_authority", "llm")]
        ) as ch:
            try:
                out = ch.unary_unary(method)(b"", metadata=(("x-api-key", key),), timeout=10)
            except grpc.RpcError as e:
                return e.code().name, {}
        return "OK", json.loads(out)

    def stat(self, name: str) -> int:
        return self.inbound.stat(name)


def _supervised(cp: XdsServer, d: Path, node: str, sa: str, **kw) -> Sidecar:
    return identity_sidecar(cp, d, node, join_token_file(cp, sa, d), **kw)


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    d = short_dir()
    inbound_port = free_port()
    with EchoGrpcUpstream() as runtime:
        spec = parse_mesh(mesh_doc(runtime.port, inbound_port, CALLERS))
        cp = build_server(spec, debounce=0.02, identity_dir=str(d / "cp")).start()
        sidecars: list[Sidecar] = []
        try:
            inbound = _supervised(
                cp, d, "llm-1", "default/llm", service="llm", version="v1",
                inbound_port=inbound_port, local_endpoint=f"127.0.0.1:{runtime.port}",
            )  # fmt: skip
            ports = {"apps/chat": free_port(), "apps/mail": free_port()}
            callers = [
                _supervised(cp, d, sa.replace("/", "-"), sa, outbound_port=port)
                for sa, port in ports.items()
            ]
            sidecars = [inbound, *callers]
            for s in sidecars:
                s.sv.start()
            for s in sidecars:
                s.sv.wait_ready()
            m = Mesh(cp, inbound, ports, runtime.port, inbound_port)
            eventually(lambda: m.call("apps/chat")[0] == "OK", 30, "a call through both sidecars")
            yield m
        finally:
            for s in sidecars:
                s.sv.stop()
            cp.stop()
            shutil.rmtree(d, ignore_errors=True)


def test_a_listed_workload_gets_through_and_the_runtime_learns_who_called(mesh: Mesh) -> None:
    status, seen = mesh.call("apps/chat")
    assert status == "OK"
    assert seen["x-meshlm-principal"] == CHAT_ID
    assert f";URI={CHAT_ID}" in seen["x-forwarded-client-cert"]  # Envoy's own, any authz mode
    assert seen["x-meshlm-tenant"] == "acme" and "x-api-key" not in seen
    assert mesh.stat(INBOUND + "rbac.meshlm_callers.policy.caller:apps/chat.allowed") >= 1
    # The Wasm filter read the same certificate and allowed by the same rule.
    assert mesh.stat("wasmcustom.meshlm_authz.caller.allowed.apps/chat") >= 1


def test_another_workload_with_the_same_valid_key_is_denied_before_the_key_check(
    mesh: Mesh,
) -> None:
    denied = INBOUND + "rbac.meshlm_callers.denied"
    before, wasm_before = mesh.stat(denied), mesh.stat("wasmcustom.meshlm_authz.allowed.acme")
    assert mesh.call("apps/mail") == ("PERMISSION_DENIED", {})
    assert mesh.stat(denied) == before + 1
    # RBAC answered: the Wasm filter never saw the call (no key was looked at).
    assert mesh.stat("wasmcustom.meshlm_authz.allowed.acme") == wasm_before
    assert mesh.stat("wasmcustom.meshlm_authz.denied.unknown_caller") == 0


def test_a_listed_workload_calls_only_its_methods_and_still_needs_a_key(mesh: Mesh) -> None:
    assert mesh.call("apps/chat", INFO) == ("PERMISSION_DENIED", {})
    assert mesh.call("apps/chat", key="stolen")[0] == "UNAUTHENTICATED"


def test_a_client_cannot_claim_a_principal(mesh: Mesh) -> None:
    with grpc.insecure_channel(
        f"127.0.0.1:{mesh.callers['apps/chat']}", options=[("grpc.default_authority", "llm")]
    ) as ch:
        md = (("x-api-key", KEY), ("x-meshlm-principal", f"spiffe://{TD}/ns/apps/sa/admin"))
        seen = json.loads(ch.unary_unary(GENERATE)(b"", metadata=md, timeout=10))
    assert seen["x-meshlm-principal"] == CHAT_ID


def test_a_changed_callers_list_applies_to_live_sidecars(mesh: Mesh) -> None:
    both = [*CALLERS, {"service_account": "apps/*", "methods": ["Info"]}]
    try:
        doc = mesh_doc(mesh.runtime_port, mesh.inbound_port, both)
        assert mesh.cp.update_mesh(parse_mesh(doc)).ok
        eventually(lambda: mesh.call("apps/mail", INFO)[0] == "OK", 20, "mail may call Info")
        assert mesh.call("apps/mail", GENERATE)[0] == "PERMISSION_DENIED"
        assert mesh.call("apps/chat", GENERATE)[0] == "OK"
    finally:
        doc = mesh_doc(mesh.runtime_port, mesh.inbound_port, CALLERS)
        assert mesh.cp.update_mesh(parse_mesh(doc)).ok

"""The authz slot of the inbound listener, delivered by ECDS: the Wasm filter from
`wasm_filters.xds` guards the runtime, and a policy change arrives without a listener drain."""

from __future__ import annotations

import json

import grpc
import pytest

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_xds_support import upstreams
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.server import XdsServer

GENERATE = "/meshlm.inference.v1.Inference/Generate"
TOKENIZE = "/meshlm.inference.v1.Inference/Tokenize"


def _mesh(runtime: str, tenants: dict) -> object:
    return parse_mesh(
        {
            "services": {"llm": {"versions": {"v1": {"endpoints": [runtime]}}}},
            "tenants": tenants,
        }
    )


TENANTS = {
    "acme": {"key_sha256": hash_key("demo-acme-key"), "allow": ["llm/*"]},
    "free": {"key_sha256": hash_key("demo-free-key"), "allow": ["llm/Generate"]},
}


def _call(channel: grpc.Channel, method: str, key: str | None) -> str:
    md = (("x-api-key", key),) if key else ()
    try:
        return channel.unary_unary(method)(b"", metadata=md, timeout=10).decode()
    except grpc.RpcError as e:
        return e.code().name


def _inbound(cp: XdsServer, node_id: str, runtime: str) -> tuple[dict, int]:
    """The bootstrap of a runtime-side sidecar for llm/v1 in front of `runtime`, and its port."""
    port = free_port()
    b = ads_bootstrap(
        node_id,
        xds_address=("127.0.0.1", cp.grpc_port),
        service="llm",
        version="v1",
        inbound_port=port,
        local_endpoint=runtime,
    )
    return b, port


def test_inbound_listener_enforces_the_policy_from_ecds() -> None:
    with upstreams("runtime") as ups:
        runtime = ups["runtime"].address
        cp = build_server(_mesh(runtime, TENANTS), debounce=0.02).start()
        assert cp.mesh.authz.mode == "wasm"  # the default once tenants exist
        b, port = _inbound(cp, "runtime-side-1", runtime)
        try:
            with EnvoyProcess(b) as envoy, grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                assert _call(ch, GENERATE, "demo-acme-key") == "runtime"
                assert _call(ch, GENERATE, None) == "UNAUTHENTICATED"
                assert _call(ch, TOKENIZE, "demo-free-key") == "PERMISSION_DENIED"
                assert _call(ch, GENERATE, "demo-free-key") == "runtime"
                ecds = cp.syncz()["nodes"]["runtime-side-1"]["types"]["ECDS"]
                assert ecds["acked_version"] == ecds["sent_version"]
                drained = envoy.stats("listener_manager.total_listeners_draining")
                # A policy change (acme removed) arrives by ECDS: no listener drains.
                result = cp.update_mesh(_mesh(runtime, {"free": TENANTS["free"]}), timeout=20)
                assert result.ok, result
                assert _call(ch, GENERATE, "demo-acme-key") == "UNAUTHENTICATED"
                assert _call(ch, GENERATE, "demo-free-key") == "runtime"
                assert envoy.stats("listener_manager.total_listeners_draining") == drained
                lds = cp.syncz()["nodes"]["runtime-side-1"]["types"]["LDS"]
                assert lds["pushes"] == 1  # the listener itself was not resent
        finally:
            cp.stop()


def test_native_mode_needs_a_keys_file() -> None:
    with pytest.raises(ValueError, match=r"authz\.keys_file"):
        parse_mesh(
            {
                "services": {"llm": {"versions": {"v1": {"endpoints": ["127.0.0.1:1"]}}}},
                "tenants": TENANTS,
                "authz": {"mode": "native"},
            }
        )


def test_native_mode_from_the_control_plane_enforces_the_same_policy(tmp_path) -> None:
    """The non-Wasm fallback: Envoy's own filters, pushed over LDS, give the same decisions."""
    keys = tmp_path / "keys.yaml"
    keys.write_text("acme: demo-acme-key\nfree: demo-free-key\n")
    keys.chmod(0o600)
    with upstreams("runtime") as ups:
        runtime = ups["runtime"].address
        raw = {
            "services": {"llm": {"versions": {"v1": {"endpoints": [runtime]}}}},
            "tenants": TENANTS,
            "authz": {"mode": "native", "keys_file": str(keys)},
        }
        cp = build_server(parse_mesh(raw), debounce=0.02).start()
        b, port = _inbound(cp, "runtime-side-native", runtime)
        try:
            with EnvoyProcess(b) as envoy, grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                assert _call(ch, GENERATE, "demo-acme-key") == "runtime"
                assert _call(ch, GENERATE, "demo-free-key") == "runtime"
                assert _call(ch, GENERATE, None) == "UNAUTHENTICATED"
                assert _call(ch, GENERATE, "not-a-key") == "UNAUTHENTICATED"
                assert _call(ch, TOKENIZE, "demo-free-key") == "PERMISSION_DENIED"
                assert "ECDS" not in cp.syncz()["nodes"]["runtime-side-native"]["types"]
                # Envoy holds the plaintext keys (the native trade-off) but never shows them.
                assert "demo-acme-key" not in json.dumps(envoy.config_dump())
                assert "demo-acme-key" not in json.dumps(cp.config_dump())
        finally:
            cp.stop()

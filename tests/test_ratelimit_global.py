"""A tenant's rate limit is a mesh-wide promise (issue 9, defect 5). With `rate_limits:
{mode: global}` (exact, one call to the control plane per request; the default divides the
limits among the sidecars instead: test_ratelimit_shares.py) the control plane's
RateLimitService holds one bucket per (service, tenant) for every inbound sidecar, and the
authz filter's per-sidecar buckets are the local tier while the control plane is down."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from mesh_common.ports import free_port
from sidecar import bootstrap
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_xds_support import eventually, upstreams
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.ratelimit.service import DOMAIN
from xds_server.resources import ratelimit as ratelimit_resource

GENERATE = "/meshlm.inference.v1.Inference/Generate"
NO_REFILL = {"tokens_per_fill": 1, "fill_interval": "1h"}
TENANTS = {
    "acme": {
        "key_sha256": hash_key("k-acme"),
        "allow": ["llm/*"],
        "rate_limit": {"max_tokens": 5, **NO_REFILL},
    },
    "beta": {
        "key_sha256": hash_key("k-beta"),
        "allow": ["llm/*"],
        "rate_limit": {"max_tokens": 5, **NO_REFILL},
    },
    "gamma": {
        "key_sha256": hash_key("k-gamma"),
        "allow": ["llm/*"],
        "rate_limit": {"max_tokens": 5, **NO_REFILL},
    },
    "free": {"key_sha256": hash_key("k-free"), "allow": ["llm/*"]},
}


def _raw(ups: dict, tenants: dict, **authz: object) -> dict:
    raw = {
        "services": {
            "llm": {
                "versions": {v: {"endpoints": [u.address]} for v, u in sorted(ups.items())},
                "route": {"weights": {"v1": 50, "v2": 50}},
            }
        },
        "tenants": tenants,
        "rate_limits": {"mode": "global"},
    }
    if authz:
        raw["authz"] = authz
    return raw


def _call(ch: grpc.Channel, key: str) -> str:
    try:
        return ch.unary_unary(GENERATE)(b"", metadata=(("x-api-key", key),), timeout=10).decode()
    except grpc.RpcError as e:
        return e.code().name


def _alternate(channels: list[grpc.Channel], key: str, n: int) -> list[str]:
    return [_call(channels[i % len(channels)], key) for i in range(n)]


def _two_versions_enforce_one_limit(make_raw: Callable[[dict], dict]) -> None:
    with upstreams("v1", "v2") as ups:
        cp = build_server(parse_mesh(make_raw(ups)), debounce=0.02).start()
        envoys, channels = [], []
        try:
            for v, u in sorted(ups.items()):
                port = free_port()
                envoys.append(
                    EnvoyProcess(
                        ads_bootstrap(
                            f"llm-{v}",
                            xds_address=("127.0.0.1", cp.grpc_port),
                            service="llm",
                            version=v,
                            inbound_port=port,
                            local_endpoint=u.address,
                        )
                    ).start()
                )
                channels.append(grpc.insecure_channel(f"127.0.0.1:{port}"))
            for envoy in envoys:
                envoy.wait_ready(timeout=60)
            for ch, v in zip(channels, sorted(ups), strict=True):
                eventually(lambda ch=ch, v=v: _call(ch, "k-free") == v, 30, f"{v} serves")

            got = _alternate(channels, "k-acme", 10)
            # One bucket for both sidecars: 5 calls in all, not 5 per sidecar (10 before).
            assert got.count("v1") + got.count("v2") == 5, got
            assert got[5:] == ["RESOURCE_EXHAUSTED"] * 5, got
            # Denied by the global tier (the local bucket of v1 still has a token for gamma).
            assert _alternate(channels, "k-gamma", 5) == ["v1", "v2"] * 2 + ["v1"]
            with pytest.raises(grpc.RpcError) as e:
                channels[1].unary_unary(GENERATE)(b"", metadata=(("x-api-key", "k-gamma"),))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.value.details() == "tenant rate limit exceeded (mesh-wide)"
            assert dict(e.value.trailing_metadata())["retry-after"] == "3600"  # the next fill

            # The control plane down: the sidecars fall back on their own buckets (fail open
            # for the global tier), so a tenant gets at most N x its limit through N sidecars.
            cp.stop()
            got = _alternate(channels, "k-beta", 14)
            assert len([g for g in got if g in ("v1", "v2")]) == 10, got
            assert _call(channels[0], "k-free") == "v1"
        finally:
            cp.stop()
            for ch in channels:
                ch.close()
            for envoy in envoys:
                envoy.stop()


def test_two_versions_share_one_tenant_limit_wasm() -> None:
    _two_versions_enforce_one_limit(lambda ups: _raw(ups, TENANTS))


def test_two_versions_share_one_tenant_limit_native(tmp_path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("acme: k-acme\nbeta: k-beta\ngamma: k-gamma\nfree: k-free\n")
    keys.chmod(0o600)
    _two_versions_enforce_one_limit(
        lambda ups: _raw(ups, TENANTS, mode="native", keys_file=str(keys))
    )


def _ask(stub: rls_pb2_grpc.RateLimitServiceStub, tenant: str, domain: str = DOMAIN) -> str:
    d = rls_pb2.RateLimitRequest(domain=domain)
    e = d.descriptors.add().entries
    e.add(key="tenant", value=tenant)
    e.add(key="service", value="llm")
    return rls_pb2.RateLimitResponse.Code.Name(stub.ShouldRateLimit(d, timeout=5).overall_code)


def test_limits_follow_the_control_plane_mesh_and_bad_requests_are_invalid() -> None:
    with upstreams("v1", "v2") as ups:
        cp = build_server(parse_mesh(_raw(ups, TENANTS)), debounce=0.02).start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{cp.grpc_port}") as ch:
                stub = rls_pb2_grpc.RateLimitServiceStub(ch)
                assert [_ask(stub, "acme") for _ in range(6)] == ["OK"] * 5 + ["OVER_LIMIT"]
                assert [_ask(stub, "free") for _ in range(6)] == ["OK"] * 6  # no limit
                assert _ask(stub, "nobody") == "OK"  # not ours to limit: authz decides
                # A new mesh (apply) changes the limits at once: acme gets more room.
                more = dict(TENANTS, acme=dict(TENANTS["acme"], rate_limit={"max_tokens": 9,
                            "tokens_per_fill": 4, "fill_interval": "1ms"}))  # fmt: skip
                assert cp.update_mesh(parse_mesh(_raw(ups, more)), timeout=0).version
                assert _ask(stub, "acme") == "OK"
                with pytest.raises(grpc.RpcError) as e:
                    _ask(stub, "acme", domain="other")
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "domain" in (e.value.details() or "")
                with pytest.raises(grpc.RpcError) as e:
                    stub.ShouldRateLimit(rls_pb2.RateLimitRequest(domain=DOMAIN), timeout=5)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            cp.stop()


def test_the_filter_asks_the_cluster_every_sidecar_bootstrap_has() -> None:
    assert ratelimit_resource.XDS_CLUSTER == bootstrap.XDS_CLUSTER

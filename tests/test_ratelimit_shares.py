"""A tenant's mesh-wide rate limit at local cost (issue 19): the control plane divides it among
the live inbound sidecars of the service and pushes each its share as its own token buckets,
re-divided as sidecars join and leave. No call asks the control plane (issue 9 asked it on
every call), and the limit still holds across replicas."""

from __future__ import annotations

import json
from collections import Counter

import grpc
import pytest
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2 as wasm_filter_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from google.protobuf import wrappers_pb2

from mesh_common import type_urls as t
from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_xds_support import Upstream, eventually, upstreams
from wasm_filters.policy import RateLimit, hash_key
from xds_server.compose import build_server
from xds_server.mesh import Mesh, MeshError, SloState, parse_mesh
from xds_server.resources.build import build_resources
from xds_server.resources.names import AUTHZ_FILTER
from xds_server.resources.ratelimit import MAX_FILL_INTERVAL_MS, share
from xds_server.server import XdsServer
from xds_server.xds.node import NodeInfo
from xds_server.xds.snapshot import make_version

GENERATE = "/meshlm.inference.v1.Inference/Generate"
# Bursts against bucket sizes, not rates: one token an hour refills nothing during a test.
LIMIT = {"max_tokens": 10, "tokens_per_fill": 1, "fill_interval": "1h"}
TENANTS = {
    name: {"key_sha256": hash_key(f"k-{name}"), "allow": ["llm/*"], "rate_limit": LIMIT}
    for name in ("acme", "beta", "gamma")
}
TENANTS["free"] = {"key_sha256": hash_key("k-free"), "allow": ["llm/*"]}
# Every request a sidecar sends to the control plane's cluster (the ADS stream is one).
TO_CONTROL_PLANE = r"^cluster\.xds_cluster\.upstream_rq_total$"
RATELIMIT = "envoy.filters.http.ratelimit"  # the global tier's filter (asks the control plane)
# A new channel of this process may take up a connection an earlier channel to the same address
# left in grpc's global subchannel pool: one opened before the listener update, whose old filter
# chain holds the old shares (red once in CI: a burst through a got the whole limit, 10, after
# the halved shares were ACKed). Each channel gets its own connection.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


class Sidecar:
    """An inbound sidecar of llm/v1 in front of one replica, and a channel to it."""

    def __init__(self, cp: XdsServer, name: str, replica: Upstream, authz: str) -> None:
        port = free_port()
        xds = ("127.0.0.1", cp.grpc_port)
        boot = ads_bootstrap(name, xds_address=xds, service="llm", version="v1",
                             inbound_port=port, local_endpoint=replica.address)  # fmt: skip
        self.name = name
        self.envoy = EnvoyProcess(boot).start()
        self.address = f"127.0.0.1:{port}"
        # Native filters are part of the listener: new shares reach new connections (the old
        # listener drains). The Wasm filter's come by ECDS, to open connections too.
        self.reconnect = authz == "native"
        self.channel = grpc.insecure_channel(self.address, options=OWN_CONNECTION)
        self.envoy.wait_ready(timeout=60)
        eventually(lambda: self.call("free") == replica.name, 30, f"{name} serves")

    def call(self, tenant: str) -> str:
        try:
            md = (("x-api-key", f"k-{tenant}"),)
            return self.channel.unary_unary(GENERATE)(b"", metadata=md, timeout=10).decode()
        except grpc.RpcError as e:
            return e.code().name

    def burst(self, tenant: str, n: int = 14) -> Counter[str]:
        """`n` calls of `tenant`; asserts none of them asked the control plane anything."""
        if self.reconnect:
            self.channel.close()
            self.channel = grpc.insecure_channel(self.address, options=OWN_CONNECTION)
        before = self.envoy.stats(TO_CONTROL_PLANE)
        got = Counter(self.call(tenant) for _ in range(n))
        assert self.envoy.stats(TO_CONTROL_PLANE) == before, f"{self.name} asked the control plane"
        return got

    def stop(self) -> None:
        self.channel.close()
        self.envoy.stop()


WARMING = r"^listener_manager\.total_listeners_warming$"


def shares_for(cp: XdsServer, sidecars: list[Sidecar]) -> bool:
    """The limits are divided among exactly `sidecars`, every one of them ACKed that, and none
    still warms a listener: Envoy ACKs a listener before it serves, and until then new
    connections reach the old one (native filters, with the old shares: red once in CI)."""
    if cp.mesh.services["llm"].inbound_sidecars != len(sidecars):
        return False
    version = make_version(cp.incarnation, cp.cache.generation)
    if not cp.wait_for_ack(version, [s.name for s in sidecars], timeout=10).ok:
        return False
    return all(not any(s.envoy.stats(WARMING).values()) for s in sidecars)


def _mesh(endpoints: list[str], **top: object) -> dict:
    return {"services": {"llm": {"versions": {"v1": {"endpoints": endpoints}}}},
            "tenants": TENANTS, **top}  # fmt: skip


@pytest.mark.parametrize("authz", ["wasm", "native"])
def test_replicas_share_a_tenant_limit_without_asking_the_control_plane(authz, tmp_path) -> None:
    top: dict = {}
    if authz == "native":
        keys = tmp_path / "keys.yaml"
        keys.write_text("".join(f"{t}: k-{t}\n" for t in TENANTS))
        keys.chmod(0o600)
        top["authz"] = {"mode": "native", "keys_file": str(keys)}
    with upstreams("ra", "rb", "rc") as ups:
        cp = build_server(
            parse_mesh(_mesh([u.address for u in ups.values()], **top)), debounce=0.02
        ).start()
        live: list[Sidecar] = []
        try:
            live.append(Sidecar(cp, "llm-a", ups["ra"], authz))
            live.append(Sidecar(cp, "llm-b", ups["rb"], authz))
            a, b = live
            eventually(lambda: shares_for(cp, [a, b]), 30, "the limits divided between a and b")
            # 10 calls in all through two sidecars, not 10 each (20 with per-sidecar limits).
            assert a.burst("acme") == Counter(ra=5, RESOURCE_EXHAUSTED=9)
            assert b.burst("acme") == Counter(rb=5, RESOURCE_EXHAUSTED=9)

            live.remove(b)
            b.stop()  # b leaves: a holds the whole limit after the push
            eventually(lambda: shares_for(cp, [a]), 30, "the limits back on a alone")
            assert a.burst("beta") == Counter(ra=10, RESOURCE_EXHAUSTED=4)

            live.append(Sidecar(cp, "llm-c", ups["rc"], authz))  # c joins: halves again
            c = live[-1]
            eventually(lambda: shares_for(cp, [a, c]), 30, "the limits divided between a and c")
            # The control plane down: each sidecar keeps its share (no N x the limit).
            cp.stop()
            assert a.burst("gamma") + c.burst("gamma") == Counter(ra=5, rc=5, RESOURCE_EXHAUSTED=18)
            assert a.call("free") == "ra"
        finally:
            cp.stop()
            for s in live:
                s.stop()


# -- what each sidecar is given, without Envoy --------------------------------------------------


def _pushed(mesh: Mesh) -> tuple[list[str], dict[str, dict | None]]:
    """The inbound listener's filters and the Wasm filter's limits per tenant, as built for
    one sidecar of llm/v1."""
    res = build_resources(mesh, NodeInfo(service="llm", version="v1", inbound_port=1))
    (listener,) = res[t.LISTENER].values()
    hcm = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    wasm = wasm_filter_pb2.Wasm()
    res[t.EXTENSION_CONFIG][AUTHZ_FILTER].typed_config.Unpack(wasm)
    conf = wrappers_pb2.StringValue()
    wasm.config.configuration.Unpack(conf)
    limits = {tn["name"]: tn["rate_limit"] for tn in json.loads(conf.value)["tenants"]}
    return [f.name for f in hcm.http_filters], limits


def test_each_sidecar_is_pushed_its_share_and_no_rate_limit_service() -> None:
    mesh = parse_mesh(_mesh(["127.0.0.1:1"]))
    filters, limits = _pushed(mesh.with_inbound_sidecars("llm", 2))
    assert AUTHZ_FILTER in filters and RATELIMIT not in filters
    assert limits["acme"] == {"max_tokens": 5, "tokens_per_fill": 1, "fill_interval_ms": 7_200_000}
    assert limits["free"] is None
    assert _pushed(mesh.with_inbound_sidecars("llm", 1))[1]["acme"]["max_tokens"] == 10
    # The SLO loop's shed (a quarter of the limit) is divided too.
    shed = mesh.with_slo_state("llm", SloState(("acme", "free"))).with_inbound_sidecars("llm", 2)
    assert _pushed(shed)[1]["acme"]["max_tokens"] == 1  # 10 // 4 = 2, halved
    assert _pushed(shed)[1]["free"] == {"max_tokens": 1, "tokens_per_fill": 1,
                                        "fill_interval_ms": 2000}  # fmt: skip


def test_global_mode_asks_the_rate_limit_service_and_keeps_whole_local_buckets() -> None:
    mesh = parse_mesh(_mesh(["127.0.0.1:1"], rate_limits={"mode": "global"}))
    filters, limits = _pushed(mesh.with_inbound_sidecars("llm", 2))
    assert filters.index(RATELIMIT) == filters.index(AUTHZ_FILTER) + 1
    assert limits["acme"]["max_tokens"] == 10


def test_rate_limits_mode_in_the_mesh_file() -> None:
    base = {"services": {"llm": {"versions": {"v1": {"endpoints": ["127.0.0.1:1"]}}}}}
    assert parse_mesh(base).rate_limits.mode == "local"
    assert parse_mesh({**base, "rate_limits": {"mode": "global"}}).rate_limits.mode == "global"
    with pytest.raises(
        MeshError, match=r"^rate_limits.mode: expected one of local, global, got 'exact'"
    ):
        parse_mesh({**base, "rate_limits": {"mode": "exact"}})
    with pytest.raises(MeshError, match=r"^rate_limits.burst: unknown field"):
        parse_mesh({**base, "rate_limits": {"burst": 1}})


@pytest.mark.parametrize(
    ("limit", "n", "want"),
    [
        ((10, 1, 3_600_000), 2, (5, 1, 7_200_000)),
        ((40, 20, 1000), 3, (13, 7, 1050)),  # 7 per 1.05 s = 6.67/s, a third of 20/s
        ((5, 5, 1000), 2, (3, 3, 1200)),  # a bucket holds at least one fill
        ((1, 1, 1000), 5, (1, 1, 5000)),
        ((5, 1, 3_600_000), 100, (1, 1, 86_400_000)),  # the filter's longest interval
        ((8, 4, 250), 1, (8, 4, 250)),
        ((8, 4, 250), 0, (8, 4, 250)),  # no sidecar counted yet: the whole limit
    ],
)
def test_share(limit: tuple[int, int, int], n: int, want: tuple[int, int, int]) -> None:
    got = share(RateLimit(*limit), n)
    assert (got.max_tokens, got.tokens_per_fill, got.fill_interval_ms) == want
    # Never a higher rate than 1/n of the limit's, unless that takes more than a day.
    assert (
        got.fill_interval_ms == MAX_FILL_INTERVAL_MS
        or got.tokens_per_fill * limit[2] * max(n, 1) <= limit[1] * got.fill_interval_ms
    )

"""ADS protocol details with a plain gRPC client (no Envoy): nonces, ACK/NACK, never resending a
rejected version, delta subscriptions and removals, make before break, debounce, versions."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.service.discovery.v3 import discovery_pb2

from mesh_common import type_urls as t
from tests.test_xds_support import AdsClient, sotw
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.resources import clusters, endpoints, listeners
from xds_server.server import XdsServer
from xds_server.xds.snapshot import InconsistentSnapshot, build_snapshot

MESH = {
    "services": {
        "llm": {
            "versions": {
                "v1": {"endpoints": ["127.0.0.1:50051"]},
                "v2": {"endpoints": ["127.0.0.1:50052"]},
            },
            "route": {"weights": {"v1": 100}},
        }
    }
}


@pytest.fixture
def cp() -> Iterator[XdsServer]:
    plane = build_server(parse_mesh(MESH), debounce=0.02).start()
    try:
        yield plane
    finally:
        plane.stop()


def names_of(resp) -> set[str]:
    out = set()
    for a in resp.resources:
        msg = cluster_pb2.Cluster() if a.type_url == t.CLUSTER else None
        if msg is not None:
            a.Unpack(msg)
            out.add(msg.name)
    return out


def test_ack_records_version_and_nothing_more_is_sent(cp: XdsServer) -> None:
    c = AdsClient(cp.grpc_port, "n1")
    try:
        c.send(sotw(t.CLUSTER))
        r = c.recv()
        assert r.version_info.startswith(cp.incarnation + ".")
        assert names_of(r) == {"outbound|llm|v1", "outbound|llm|v2"}
        c.send(sotw(t.CLUSTER, version=r.version_info, nonce=r.nonce))
        c.assert_quiet()
        cds = _sync(cp, "n1", "CDS")
        assert cds["acked_version"] == r.version_info and cds["pushes"] == 1
    finally:
        c.close()


def test_stale_nonce_is_ignored(cp: XdsServer) -> None:
    c = AdsClient(cp.grpc_port, "n1")
    try:
        c.send(sotw(t.CLUSTER))
        r1 = c.recv()
        cp.update_mesh(_with_version(cp, "v3", "127.0.0.1:50053"), timeout=0)
        r2 = c.recv()
        assert r2.version_info != r1.version_info
        # A NACK for the older response arrives after the newer one was sent (envoy#10363).
        c.send(sotw(t.CLUSTER, version="", nonce=r1.nonce, error="old complaint"))
        c.assert_quiet()
        cds = _sync(cp, "n1", "CDS")
        assert cds["stale_nonces"] == 1 and cds["nack_error"] == ""
        c.send(sotw(t.CLUSTER, version=r2.version_info, nonce=r2.nonce))
        _eventually(lambda: _sync(cp, "n1", "CDS")["acked_version"] == r2.version_info)
    finally:
        c.close()


def test_nack_is_recorded_and_the_rejected_version_never_resent(cp: XdsServer) -> None:
    c = AdsClient(cp.grpc_port, "n1")
    try:
        c.send(sotw(t.CLUSTER))
        r1 = c.recv()
        c.send(sotw(t.CLUSTER, version=r1.version_info, nonce=r1.nonce))
        cp.update_mesh(_with_version(cp, "v3", "127.0.0.1:50053"), timeout=0)
        r2 = c.recv()
        c.send(sotw(t.CLUSTER, version=r1.version_info, nonce=r2.nonce, error="bad cluster"))
        c.assert_quiet(0.6)  # no resend loop (go-control-plane #582/#962)
        cds = _sync(cp, "n1", "CDS")
        assert cds["nack_version"] == r2.version_info and cds["nack_error"] == "bad cluster"
        assert cds["acked_version"] == r1.version_info and cds["pushes"] == 2
        result = cp.wait_for_ack(r2.version_info, ["n1"], timeout=1)
        assert not result.ok and "bad cluster" in result.errors["n1"]
        # Only a new version goes out.
        cp.set_weights("llm", {"v1": 50, "v2": 50}, timeout=0)
        cp.update_mesh(_with_version(cp, "v4", "127.0.0.1:50054"), timeout=0)
        r3 = c.recv()
        assert r3.version_info not in (r1.version_info, r2.version_info)
    finally:
        c.close()


def test_sotw_make_before_break_keeps_stale_clusters_until_routes_acked(cp: XdsServer) -> None:
    c = AdsClient(cp.grpc_port, "n1")
    try:
        acked = _sotw_boot(c)
        mesh = parse_mesh(
            {
                "services": {
                    "llm": {
                        "versions": {"v2": {"endpoints": ["127.0.0.1:50052"]}},
                        "route": {"weights": {"v2": 100}},
                    }
                }
            }
        )
        cp.update_mesh(mesh, timeout=0)
        first = c.recv()
        assert first.type_url == t.CLUSTER
        assert names_of(first) == {"outbound|llm|v1", "outbound|llm|v2"}  # v1 kept for now
        assert "~keep-" in first.version_info
        c.send(sotw(t.CLUSTER, version=first.version_info, nonce=first.nonce))
        eds = c.recv()
        assert eds.type_url == t.ENDPOINT
        c.send(
            sotw(t.ENDPOINT, ["outbound|llm|v1", "outbound|llm|v2"], eds.version_info, eds.nonce)
        )
        rds = c.recv()
        assert rds.type_url == t.ROUTE
        c.assert_quiet(0.3)  # the old cluster stays until the new routes are ACKed
        c.send(sotw(t.ROUTE, ["outbound"], rds.version_info, rds.nonce))
        final = c.recv()
        assert final.type_url == t.CLUSTER and names_of(final) == {"outbound|llm|v2"}
        assert "~" not in final.version_info and final.version_info != acked[t.CLUSTER]
    finally:
        c.close()


def test_delta_unsubscribe_subscribe_and_unknown_names(cp: XdsServer) -> None:
    c = AdsClient(cp.grpc_port, "d1", delta=True)
    try:
        c.send(
            discovery_pb2.DeltaDiscoveryRequest(
                type_url=t.ENDPOINT, resource_names_subscribe=["outbound|llm|v1", "nope"]
            )
        )
        r = c.recv()
        assert [x.name for x in r.resources] == ["outbound|llm|v1"]
        assert list(r.removed_resources) == ["nope"]  # tells the client it does not exist
        c.send(discovery_pb2.DeltaDiscoveryRequest(type_url=t.ENDPOINT, response_nonce=r.nonce))
        c.send(
            discovery_pb2.DeltaDiscoveryRequest(
                type_url=t.ENDPOINT, resource_names_unsubscribe=["outbound|llm|v1"]
            )
        )
        cp.add_endpoint("llm", "v1", "127.0.0.1:50061", timeout=0)
        c.assert_quiet()  # no longer subscribed: nothing sent
        c.send(
            discovery_pb2.DeltaDiscoveryRequest(
                type_url=t.ENDPOINT, resource_names_subscribe=["outbound|llm|v1"]
            )
        )
        r2 = c.recv()
        assert [x.name for x in r2.resources] == ["outbound|llm|v1"]
        assert r2.resources[0].version != r.resources[0].version  # per-resource hash version
    finally:
        c.close()


def test_delta_sends_only_changes_and_removals(cp: XdsServer) -> None:
    c = AdsClient(cp.grpc_port, "d1", delta=True)
    try:
        c.send(discovery_pb2.DeltaDiscoveryRequest(type_url=t.CLUSTER))  # wildcard
        r = c.recv()
        assert {x.name for x in r.resources} == {"outbound|llm|v1", "outbound|llm|v2"}
        c.send(discovery_pb2.DeltaDiscoveryRequest(type_url=t.CLUSTER, response_nonce=r.nonce))
        cp.update_mesh(_with_version(cp, "v3", "127.0.0.1:50053"), timeout=0)
        r2 = c.recv()
        assert [x.name for x in r2.resources] == ["outbound|llm|v3"] and not r2.removed_resources
        c.send(discovery_pb2.DeltaDiscoveryRequest(type_url=t.CLUSTER, response_nonce=r2.nonce))
        mesh = parse_mesh(MESH)
        result = cp.update_mesh(mesh, timeout=0)
        r3 = c.recv()
        assert list(r3.removed_resources) == ["outbound|llm|v3"] and not r3.resources
        c.send(discovery_pb2.DeltaDiscoveryRequest(type_url=t.CLUSTER, response_nonce=r3.nonce))
        _eventually(lambda: _sync(cp, "d1", "CDS")["acked_version"] == r3.system_version_info)
        assert result.version  # the API names the version it waited for
    finally:
        c.close()


def test_debounce_coalesces_a_burst_into_one_push() -> None:
    plane = build_server(parse_mesh(MESH), debounce=1.0).start()
    c = AdsClient(plane.grpc_port, "n1")
    try:
        acked = _sotw_boot(c)
        for w in (10, 20, 30, 40):
            plane.set_weights("llm", {"v1": 100 - w, "v2": w}, timeout=0)
        r = c.recv()
        assert r.type_url == t.ROUTE and r.version_info != acked[t.ROUTE]
        c.send(sotw(t.ROUTE, ["outbound"], r.version_info, r.nonce))
        c.assert_quiet(0.3)
        assert r.version_info == f"{plane.incarnation}.{plane.cache.generation}"
        assert plane.wait_for_ack(r.version_info, ["n1"], timeout=5).ok
    finally:
        c.close()
        plane.stop()


def test_versions_carry_a_per_incarnation_prefix() -> None:
    a = build_server(parse_mesh(MESH))
    b = build_server(parse_mesh(MESH))
    assert a.incarnation != b.incarnation
    with pytest.raises(ValueError, match="not from this control plane"):
        a.wait_for_ack(f"{b.incarnation}.1", [], timeout=0)


def test_consistency_check_rejects_a_snapshot_before_any_push() -> None:
    svc = parse_mesh(MESH).services["llm"]
    c = clusters.cluster("outbound|llm|v1", svc)
    lis = listeners.http_listener(
        "outbound",
        host="127.0.0.1",
        port=1,
        route_config_name="missing-routes",
        stat_prefix="o",
        stream_idle_timeout=1,
        authz_filters=[listeners.ecds_filter("meshlm.authz")],
    )
    with pytest.raises(InconsistentSnapshot) as e:
        build_snapshot(
            {t.CLUSTER: {c.name: c}, t.LISTENER: {"outbound": lis}}, incarnation="x", generation=1
        )
    msg = str(e.value)
    assert "cluster outbound|llm|v1: no ClusterLoadAssignment 'outbound|llm|v1'" in msg
    assert "no RouteConfiguration 'missing-routes'" in msg
    assert "no TypedExtensionConfig 'meshlm.authz'" in msg
    cla = endpoints.load_assignment(c.name, svc.versions["v1"].endpoints)
    snap = build_snapshot(
        {t.CLUSTER: {c.name: c}, t.ENDPOINT: {c.name: cla}}, incarnation="x", generation=1
    )
    assert snap.version(t.CLUSTER) == "x.1"


# -- helpers ----------------------------------------------------------------------------------


def _sotw_boot(c: AdsClient) -> dict[str, str]:
    """Subscribe like Envoy (CDS, EDS, LDS, RDS), ACK each; return the acked versions."""
    acked = {}
    c.send(sotw(t.CLUSTER))
    r = c.recv()
    c.send(sotw(t.CLUSTER, version=r.version_info, nonce=r.nonce))
    acked[t.CLUSTER] = r.version_info
    c.send(sotw(t.ENDPOINT, ["outbound|llm|v1", "outbound|llm|v2"]))
    r = c.recv()
    c.send(sotw(t.ENDPOINT, ["outbound|llm|v1", "outbound|llm|v2"], r.version_info, r.nonce))
    c.send(sotw(t.LISTENER))
    r = c.recv()
    c.send(sotw(t.LISTENER, version=r.version_info, nonce=r.nonce))
    c.send(sotw(t.ROUTE, ["outbound"]))
    r = c.recv()
    c.send(sotw(t.ROUTE, ["outbound"], r.version_info, r.nonce))
    acked[t.ROUTE] = r.version_info
    c.assert_quiet(0.2)
    return acked


def _with_version(cp: XdsServer, version: str, endpoint: str):
    raw = {
        "services": {
            "llm": {
                "versions": {
                    **MESH["services"]["llm"]["versions"],
                    version: {"endpoints": [endpoint]},
                },
                "route": {"weights": {"v1": 100}},
            }
        }
    }
    return parse_mesh(raw)


def _sync(cp: XdsServer, node: str, short: str) -> dict:
    return cp.syncz()["nodes"][node]["types"][short]


def _eventually(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met")

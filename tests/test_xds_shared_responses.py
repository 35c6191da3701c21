"""A response many streams are sent alike is built once and shared (bytes equal but for the
nonce), while a stream that holds or subscribes to something else still gets exactly its own
difference. Real control plane, real gRPC streams on loopback (no Envoy)."""

from __future__ import annotations

import gc
import weakref

import pytest
from envoy.service.discovery.v3 import discovery_pb2

from mesh_common import type_urls as t
from tests.test_xds_protocol import cp  # noqa: F401  (the fixture)
from tests.test_xds_support import AdsClient, sotw
from xds_server.server import XdsServer
from xds_server.xds.node import NodeInfo
from xds_server.xds.wire import with_nonce

V1, V2 = "outbound|llm|v1", "outbound|llm|v2"


def _without_nonce(r) -> bytes:
    r = type(r).FromString(r.SerializeToString())
    r.ClearField("nonce")
    return r.SerializeToString(deterministic=True)


def _delta_eds(plane: XdsServer, node: str, names: list[str], initial: dict | None = None):
    c = AdsClient(plane.grpc_port, node, delta=True)
    c.send(
        discovery_pb2.DeltaDiscoveryRequest(
            type_url=t.ENDPOINT,
            resource_names_subscribe=names,
            initial_resource_versions=initial or {},
        )
    )
    return c


def _ack(c: AdsClient, r) -> None:
    c.send(discovery_pb2.DeltaDiscoveryRequest(type_url=r.type_url, response_nonce=r.nonce))


def test_delta_streams_in_one_state_get_one_response_and_others_their_own(
    cp: XdsServer,  # noqa: F811
) -> None:
    both = [_delta_eds(cp, f"both-{i}", [V1, V2]) for i in range(3)]
    only_v1 = _delta_eds(cp, "only-v1", [V1])
    streams = [*both, only_v1]
    try:
        first = {}
        for c in streams:
            r = c.recv()
            first[c] = {x.name: x.version for x in r.resources}
            _ack(c, r)
        assert set(first[only_v1]) == {V1}

        cp.add_endpoint("llm", "v2", "127.0.0.1:50062", timeout=0)
        got = [c.recv() for c in both]
        assert [[x.name for x in r.resources] for r in got] == [[V2]] * 3
        assert len({_without_nonce(r) for r in got}) == 1  # one response, three nonces
        for c, r in zip(both, got, strict=True):
            _ack(c, r)
        only_v1.assert_quiet()  # not subscribed to what changed

        cp.add_endpoint("llm", "v1", "127.0.0.1:50061", timeout=0)
        got = [c.recv() for c in streams]
        assert [[x.name for x in r.resources] for r in got] == [[V1]] * 4
        assert len({_without_nonce(r) for r in got}) == 1

        # A sidecar that reconnects holding the first v1 and the current v2 gets v1 only.
        v2_now = {x.name: x.version for x in got[0].resources}
        late = _delta_eds(cp, "late", [V1, V2], {V1: first[both[0]][V1], V2: "x"})
        r = late.recv()
        assert {x.name for x in r.resources} == {V1, V2}  # its v2 hash was not ours: resent
        assert {x.name: x.version for x in r.resources}[V1] == v2_now[V1]
        late.close()
    finally:
        for c in streams:
            c.close()


def test_sotw_streams_with_the_same_names_share_a_response(cp: XdsServer) -> None:  # noqa: F811
    streams = [AdsClient(cp.grpc_port, f"s-{i}") for i in range(3)]
    try:
        for c in streams:
            c.send(sotw(t.ENDPOINT, [V1, V2]))
        for c in streams:
            r = c.recv()
            c.send(sotw(t.ENDPOINT, [V1, V2], r.version_info, r.nonce))
        cp.add_endpoint("llm", "v2", "127.0.0.1:50062", timeout=0)
        got = [c.recv() for c in streams]
        assert len({_without_nonce(r) for r in got}) == 1
        assert all(len(r.resources) == 2 for r in got)  # state of the world: both sets
    finally:
        for c in streams:
            c.close()


@pytest.mark.parametrize("nonce", ["1", "n" * 200])  # a one-byte and a two-byte length
def test_a_nonce_appended_to_shared_bytes_reads_as_the_field(nonce: str) -> None:
    for kind in (discovery_pb2.DiscoveryResponse, discovery_pb2.DeltaDiscoveryResponse):
        body = kind(type_url=t.CLUSTER).SerializeToString()
        r = kind.FromString(with_nonce(body, nonce))
        assert r.nonce == nonce and r.type_url == t.CLUSTER


def test_a_groups_shared_instance_goes_with_its_last_user() -> None:
    """Streams of one group share one NodeInfo; the table of shared instances keeps none alive
    (inbound groups are one per host, so a long-lived control plane sees many come and go)."""
    a = NodeInfo(service="llm", version="v9", inbound_port=1).interned()
    b = NodeInfo(service="llm", version="v9", inbound_port=1).interned()
    assert a is b
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None

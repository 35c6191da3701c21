"""CSDS node matchers' `safe_regex` is RE2 (linear time), as Envoy defines it: a workload with a
mesh certificate asking for `(a+)+b` against the node id "a"*29 froze the control plane (its
event loop and the ADS lock) for seconds; other sidecars could not connect meanwhile. Real
control plane with mTLS, real gRPC clients on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from envoy.service.status.v3 import csds_pb2, csds_pb2_grpc
from envoy.type.matcher.v3 import node_pb2, regex_pb2, string_pb2

from mesh_common import type_urls as t
from tests import test_ads_mtls as mtls
from tests.test_xds_support import AdsClient, eventually, sotw, upstreams
from xds_server.compose import build_server
from xds_server.server import XdsServer

VICTIM = "a" * 29  # (a+)+b on this takes Python's backtracking re 2**29 steps


@pytest.fixture(scope="module")
def cp() -> Iterator[XdsServer]:
    with upstreams("v1") as ups, build_server(mtls._mesh(ups["v1"].address), debounce=0.02) as cp:
        yield cp


def _regex(pattern: str) -> csds_pb2.ClientStatusRequest:
    m = node_pb2.NodeMatcher(
        node_id=string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=pattern))
    )
    return csds_pb2.ClientStatusRequest(node_matchers=[m], exclude_resource_contents=True)


def test_pathological_regex_answers_at_once_and_ads_keeps_serving(cp: XdsServer) -> None:
    clients = []
    ch = mtls._channel(cp, mtls.CALLER)
    try:
        victim = AdsClient(cp.grpc_port, VICTIM, channel=ch, auto_ack=True)
        clients.append(victim)
        victim.send(sotw(t.CLUSTER))
        eventually(lambda: cp.syncz()["nodes"][VICTIM]["types"]["CDS"]["acked_version"])
        stub = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(ch)
        took: dict[str, float] = {}

        def ask() -> None:
            start = time.monotonic()
            try:
                took["answer"] = len(stub.FetchClientStatus(_regex("(a+)+b"), timeout=60).config)
            finally:
                took["csds"] = time.monotonic() - start

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(0.2)  # the CSDS call is in the control plane now
        start = time.monotonic()
        other = AdsClient(cp.grpc_port, "other-1", channel=mtls._channel(cp, mtls.CALLER))
        clients.append(other)
        other.send(sotw(t.CLUSTER))
        first = other.recv(60)
        ads_seconds = time.monotonic() - start
        asker.join(120)
        assert first.type_url == t.CLUSTER
        assert took.get("answer") == 0, took  # no id ends in b
        # Generous bounds: RE2 answers in milliseconds; Python's re took tens of seconds.
        assert took["csds"] < 5, took
        assert ads_seconds < 5, ads_seconds
        anchored = stub.FetchClientStatus(_regex("a+"), timeout=10)
        assert [c.node.id for c in anchored.config] == [VICTIM]
    finally:
        for c in clients:
            c.close()
        ch.close()


def test_regexes_re2_refuses_are_invalid_argument_naming_the_field(cp: XdsServer) -> None:
    ch = mtls._channel(cp, mtls.CALLER)
    stub = csds_pb2_grpc.ClientStatusDiscoveryServiceStub(ch)
    try:
        for pattern, why in (
            (r"(a)\1", "node_matchers[0].node_id.safe_regex.regex"),  # backreference: not RE2
            ("(", "node_matchers[0].node_id.safe_regex.regex"),
            ("(a{100}){100}", "node_matchers[0].node_id.safe_regex.regex"),
            ("[a-z]{1,100}x{1,100}", "program size"),
        ):
            with pytest.raises(grpc.RpcError) as e:
                stub.FetchClientStatus(_regex(pattern), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, pattern
            assert why in e.value.details(), (pattern, e.value.details())
        many = csds_pb2.ClientStatusRequest(
            node_matchers=[node_pb2.NodeMatcher(node_id=string_pb2.StringMatcher(prefix="x"))]
            * 1000
        )
        with pytest.raises(grpc.RpcError) as e:
            stub.FetchClientStatus(many, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "node_matchers" in e.value.details()
    finally:
        ch.close()

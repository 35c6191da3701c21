"""`load_balancing: prefix_aware` in the mesh file and the Envoy resources it builds (the
behaviour on a real Envoy: test_prefix_routing_envoy.py)."""

from __future__ import annotations

from typing import Any

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    header_mutation_pb2 as early_pb2,
)

from mesh_common import type_urls as t
from mesh_common.headers import CLASS_HEADER, PREFIX_HEADER
from xds_server.mesh import MeshError, parse_mesh
from xds_server.resources import clusters, names, routes
from xds_server.resources.build import build_resources
from xds_server.xds.node import NodeInfo


def _service(**extra: Any) -> Any:
    doc = {"versions": {"v1": {"endpoints": ["127.0.0.1:9001"]}}, "route": {"weights": {"v1": 100}}}
    return parse_mesh({"services": {"llm": {**doc, **extra}}})


def _error(**extra: Any) -> str:
    with pytest.raises(MeshError) as e:
        _service(**extra)
    return str(e.value)


def test_prefix_aware_is_a_maglev_hash_with_bounded_load_by_default() -> None:
    svc = _service(load_balancing="prefix_aware").services["llm"]
    assert svc.hash_balance_factor == 110
    c = clusters.cluster("out-llm-v1", svc, caller_side=True)
    assert c.lb_policy == cluster_pb2.Cluster.MAGLEV
    assert c.common_lb_config.consistent_hashing_lb_config.hash_balance_factor.value == 110
    assert not c.HasField("load_balancing_policy")
    tuned = _service(load_balancing="prefix_aware", hash_balance_factor=125).services["llm"]
    assert tuned.hash_balance_factor == 125
    # ring_hash keeps its unbounded default, and may take a bound too
    sticky = {"weights": {"v1": 100}, "hash_policy": {"header": "x-session"}}
    assert _service(route=sticky).services["llm"].hash_balance_factor is None
    bounded = _service(route=sticky, hash_balance_factor=200).services["llm"]
    c2 = clusters.cluster("out-llm-v1", bounded, caller_side=True)
    assert c2.lb_policy == cluster_pb2.Cluster.RING_HASH
    assert c2.common_lb_config.consistent_hashing_lb_config.hash_balance_factor.value == 200


def test_the_route_hashes_the_session_first_then_the_prefix_key() -> None:
    def hash_headers(mesh: Any) -> list[tuple[str, bool]]:
        rc = routes.outbound_route_config(mesh)
        for vh in rc.virtual_hosts:
            for r in vh.routes:
                if r.route.hash_policy:
                    return [(h.header.header_name, h.terminal) for h in r.route.hash_policy]
        return []

    assert hash_headers(_service(load_balancing="prefix_aware")) == [(PREFIX_HEADER, False)]
    sticky = {"weights": {"v1": 100}, "hash_policy": {"header": "x-session"}}
    assert hash_headers(_service(route=sticky, load_balancing="prefix_aware")) == [
        ("x-session", True),
        (PREFIX_HEADER, False),
    ]
    assert hash_headers(_service(route=sticky)) == [("x-session", False)]


def test_bad_settings_name_their_field() -> None:
    assert _error(load_balancing="prefix_aware", hash_balance_factor=99) == (
        "services.llm.hash_balance_factor: 99 out of range 100.."
    )
    assert _error(load_balancing="prefix_aware", hash_balance_factor="150%") == (
        "services.llm.hash_balance_factor: expected an integer, got '150%'"
    )
    assert _error(hash_balance_factor=150) == (
        "services.llm.hash_balance_factor: bounds a consistent hash's load; needs "
        "load_balancing ring_hash or prefix_aware, not round_robin"
    )


def test_the_caller_listener_strips_client_sent_keys_before_any_filter() -> None:
    mesh = _service(load_balancing="prefix_aware")
    res = build_resources(mesh, NodeInfo(outbound_port=15001))
    listener = res[t.LISTENER][names.OUTBOUND_LISTENER]
    hcm = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    removed = {
        m.remove
        for e in hcm.early_header_mutation_extensions
        for m in _unpack_mutations(e).mutations
    }
    assert {PREFIX_HEADER, CLASS_HEADER} <= removed


def _unpack_mutations(ext: object) -> early_pb2.HeaderMutation:
    m = early_pb2.HeaderMutation()
    ext.typed_config.Unpack(m)  # type: ignore[attr-defined]
    return m

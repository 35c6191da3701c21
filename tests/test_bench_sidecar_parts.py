"""bench/sidecar_parts.py: the inbound config part by part follows what the control plane
builds (issue 19, item 3), so a new filter cannot hide inside the "bare" hop."""

from __future__ import annotations

import re

import pytest
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)

from bench import sidecar_parts as parts
from mesh_common import type_urls as t
from wasm_filters.policy import hash_key
from xds_server.mesh import parse_mesh

LIMIT = {"max_tokens": 10, "tokens_per_fill": 10, "fill_interval": "1s"}
MESH = parse_mesh(
    {
        "services": {"llm": {"versions": {"v1": {"endpoints": ["127.0.0.1:1"]}}}},
        "tenants": {"a": {"key_sha256": hash_key("k"), "allow": ["llm/*"], "rate_limit": LIMIT}},
    }
)


def _hcm(boot: dict) -> dict:
    return boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]


def test_full_keeps_every_filter_inline_and_bare_only_the_router() -> None:
    res = parts.inbound_resources(MESH, "llm", "v1", local=9)
    real = [f.name for f in parts.hcm_of(next(iter(res[t.LISTENER].values()))).http_filters]
    full = _hcm(parts.bootstrap(res, parts.PARTS, xds_port=1))
    assert [f["name"] for f in full["http_filters"]] == real
    assert all("typed_config" in f for f in full["http_filters"])  # ECDS put inline
    assert full["access_log"] and full["early_header_mutation_extensions"]
    assert "rds" not in full and full["route_config"]["virtual_hosts"]
    bare = _hcm(parts.bootstrap(res, (), xds_port=1))
    assert [f["name"] for f in bare["http_filters"]] == [parts.ROUTER]
    assert not {"access_log", "early_header_mutation_extensions", "local_reply_config"} & set(bare)


def test_a_filter_that_is_no_part_is_refused() -> None:
    res = parts.inbound_resources(MESH, "llm", "v1", local=9)
    listener = next(iter(res[t.LISTENER].values()))
    hcm = parts.hcm_of(listener)
    hcm.http_filters.insert(0, hcm_pb2.HttpFilter(name="envoy.filters.http.cors"))
    listener.filter_chains[0].filters[0].typed_config.Pack(hcm)
    with pytest.raises(
        ValueError, match=re.escape("envoy.filters.http.cors is not one of the parts")
    ):
        parts.bootstrap(res, (), xds_port=1)


def test_an_unknown_part_is_named() -> None:
    res = parts.inbound_resources(MESH, "llm", "v1", local=9)
    with pytest.raises(ValueError, match=re.escape("unknown ['tracing']")):
        parts.bootstrap(res, {"tracing"}, xds_port=1)

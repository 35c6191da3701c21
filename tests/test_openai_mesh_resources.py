"""The resources that carry the OpenAI HTTP API through the mesh (issue 17, item 2): the inbound
sidecar's route and cluster for the runtime's HTTP port, the callers RBAC and native authz on
OpenAI paths, and `meshlm sidecar --local-http-endpoint`. Real Envoys: test_openai_mesh.py."""

from __future__ import annotations

import pytest
from envoy.config.rbac.v3 import rbac_pb2
from envoy.extensions.filters.http.buffer.v3 import buffer_pb2
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as rbac_filter_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2 as hpo

from mesh_common import type_urls as t
from tests.test_cli_errors import assert_clear, meshlm
from wasm_filters.policy import hash_key, parse_policy
from wasm_filters.xds import native_http_filters
from xds_server.mesh import parse_mesh
from xds_server.resources.build import ResourceError, build_resources
from xds_server.xds.node import NodeInfo

HTTP_CLUSTER = "inbound|llm|v1|http"


def mesh(**extra):
    return parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {"v1": {"endpoints": ["127.0.0.1:9000"]}},
                    "health_check": {"interval": "1s"},
                    **extra,
                }
            },
            "tenants": {"acme": {"key_sha256": hash_key("k"), "allow": ["llm/*"]}},
        }
    )


def node(**kw) -> NodeInfo:
    return NodeInfo(
        service="llm", version="v1", inbound_port=9000, local_endpoint="127.0.0.1:5000", **kw
    )


def test_the_inbound_listener_routes_v1_to_the_runtimes_http_port() -> None:
    res = build_resources(mesh(), node(local_http_endpoint="127.0.0.1:8080"))
    c = res[t.CLUSTER][HTTP_CLUSTER]
    opts = hpo.HttpProtocolOptions()
    c.typed_extension_protocol_options[
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ].Unpack(opts)
    assert opts.explicit_http_config.HasField("http_protocol_options")  # HTTP/1.1
    assert not c.health_checks  # a gRPC probe of an HTTP/1.1 server would fail
    assert res[t.CLUSTER]["inbound|llm|v1"].health_checks
    ep = res[t.ENDPOINT][HTTP_CLUSTER].endpoints[0].lb_endpoints[0].endpoint.address
    assert (ep.socket_address.address, ep.socket_address.port_value) == ("127.0.0.1", 8080)
    routes = res[t.ROUTE]["inbound|llm|v1"].virtual_hosts[0].routes
    routes = [r for r in routes if not r.name.endswith("-shadow")]  # test_quality_mirror_spec
    assert [(r.match.prefix or r.match.path, r.route.cluster) for r in routes] == [
        ("/xds.service.orca.v3.OpenRcaService/StreamCoreMetrics", "inbound|llm|v1|orca"),
        ("/v1/", HTTP_CLUSTER),
        ("/", "inbound|llm|v1"),
    ]


def test_openai_requests_are_buffered_whole_and_every_request_has_a_deadline() -> None:
    """The inbound sidecar holds an OpenAI request until its body is complete (the buffer
    filter, off but on the /v1/ route), and bounds every request's headers and whole request:
    a slow client is held by Envoy, never by the runtime. Real Envoys: test_openai_mesh_bounds."""
    res = build_resources(mesh(), node(local_http_endpoint="127.0.0.1:8080"))
    hcm = _inbound_hcm(res)
    assert hcm.request_headers_timeout.seconds == 10 and hcm.request_timeout.seconds == 30
    names = [f.name for f in hcm.http_filters]
    assert names[-2:] == ["envoy.filters.http.buffer", "envoy.filters.http.router"]
    assert hcm.http_filters[-2].disabled  # gRPC streams are not buffered
    routes = res[t.ROUTE]["inbound|llm|v1"].virtual_hosts[0].routes
    buffered = [r.name for r in routes if "envoy.filters.http.buffer" in r.typed_per_filter_config]
    assert buffered and all("openai" in n for n in buffered)
    per_route = buffer_pb2.BufferPerRoute()
    routes[[r.name for r in routes].index(buffered[0])].typed_per_filter_config[
        "envoy.filters.http.buffer"
    ].Unpack(per_route)
    assert per_route.buffer.max_request_bytes.value == 4 << 20  # the runtime's body limit
    assert "envoy.filters.http.buffer" not in [
        f.name for f in _inbound_filters(build_resources(mesh(), node()))
    ]


def test_without_an_http_endpoint_nothing_changes() -> None:
    res = build_resources(mesh(), node())
    assert HTTP_CLUSTER not in res[t.CLUSTER]
    routes = res[t.ROUTE]["inbound|llm|v1"].virtual_hosts[0].routes
    routes = [r for r in routes if not r.name.endswith("-shadow")]  # test_quality_mirror_spec
    assert [r.match.prefix for r in routes if r.match.prefix] == ["/"]


def test_a_bad_http_endpoint_names_the_metadata_key() -> None:
    with pytest.raises(ValueError, match=r"meshlm\.local_http_endpoint"):
        build_resources(mesh(), node(local_http_endpoint="no-port"))


def test_with_mtls_the_http_port_must_be_on_loopback_too() -> None:
    m = parse_mesh(
        {
            "services": {"llm": {"versions": {"v1": {"endpoints": ["127.0.0.1:9000"]}}}},
            "identity": {"trust_domain": "meshlm.local"},
        }
    )
    with pytest.raises(ResourceError, match="not on loopback"):
        build_resources(m, node(local_http_endpoint="10.1.2.3:8080"))


def _paths(perm: rbac_pb2.Permission) -> set[str]:
    if perm.HasField("or_rules"):
        return set().union(*(_paths(p) for p in perm.or_rules.rules))
    m = perm.url_path.path
    return {m.exact or m.safe_regex.regex}


def test_callers_rbac_allows_the_openai_paths_of_the_callers_methods() -> None:
    m = parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {"v1": {"endpoints": ["127.0.0.1:9000"]}},
                    "callers": [{"service_account": "apps/chat", "methods": ["Generate"]}],
                }
            },
            "identity": {"trust_domain": "meshlm.local"},
        }
    )
    res = build_resources(m, node())
    hcm_filters = _inbound_filters(res)
    rbac = rbac_filter_pb2.RBAC()
    next(f for f in hcm_filters if f.name == "meshlm.callers").typed_config.Unpack(rbac)
    paths = _paths(rbac.rules.policies["caller:apps/chat"].permissions[0])
    assert {"/v1/chat/completions", "/v1/completions"} <= paths
    assert not any("models" in p for p in paths)


def _inbound_hcm(res) -> hcm_pb2.HttpConnectionManager:
    hcm = hcm_pb2.HttpConnectionManager()
    lst = res[t.LISTENER]["inbound|llm|v1"]
    lst.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return hcm


def _inbound_filters(res):
    return _inbound_hcm(res).http_filters


def test_native_authz_rbac_allows_the_openai_paths_of_the_tenants_methods() -> None:
    policy = parse_policy(
        {
            "gen": {"key_sha256": hash_key("g"), "allow": ["llm/Generate"]},
            "all": {"key_sha256": hash_key("a"), "allow": ["llm/*"]},
        }
    )
    filters = native_http_filters(policy, service="llm", keys={"gen": ["g"], "all": ["a"]})
    rbac = rbac_filter_pb2.RBAC()
    next(f for f in filters if f.name == "envoy.filters.http.rbac").typed_config.Unpack(rbac)
    gen = _paths(rbac.rules.policies["tenant-gen"].permissions[0])
    every = _paths(rbac.rules.policies["tenant-all"].permissions[0])
    assert {"/v1/chat/completions", "/v1/completions"} <= gen
    assert not any("models" in p for p in gen)
    assert {"/v1/models", r"/v1/models/[^/]+"} <= every


def test_sidecar_http_endpoint_needs_an_inbound_listener() -> None:
    r = meshlm(
        "sidecar", "--xds", "127.0.0.1:1", "--outbound-port", "1",
        "--local-http-endpoint", "127.0.0.1:8080",
    )  # fmt: skip
    assert_clear(r, 2, "--local-http-endpoint needs --inbound-port")

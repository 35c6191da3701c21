"""The caller sidecar's routes by model (x-meshlm-model) in the virtual host of an authority
that names no service: built from the mesh file, checked as RDS resources."""

from __future__ import annotations

import json

from xds_server.mesh import parse_mesh
from xds_server.resources import routes

EP = {"versions": {"v1": {"endpoints": ["127.0.0.1:9"]}}}


def unmatched(**services: dict) -> list:
    doc = {"services": {n: {**EP, **s} for n, s in services.items() if n != "default_service"}}
    if "default_service" in services:
        doc["default_service"] = services["default_service"]
    rc = routes.outbound_route_config(parse_mesh(doc))
    (vhost,) = [v for v in rc.virtual_hosts if v.name == "unmatched"]
    return list(vhost.routes)


def names(rs: list) -> list[str]:
    return [r.name for r in rs]


def model_match(route) -> tuple[str, bool]:
    (h,) = [h for h in route.match.headers if h.name == "x-meshlm-model"]
    return h.string_match.exact, h.string_match.ignore_case


def test_a_mesh_without_models_keeps_its_routes() -> None:
    rs = unmatched(llm={})
    assert not any(n.startswith(("model", "unknown-model")) for n in names(rs))
    assert names(rs)[0] == "forged-shadow" and names(rs)[-1] == "no-service"


def test_each_modelled_service_gets_its_routes_by_name_before_the_default() -> None:
    rs = unmatched(
        a={"model": "smollm2-int4", "aliases": ["small.v1"]},
        b={"model": "smollm2-bf16"},
        llm={},
        default_service="llm",
    )
    n = names(rs)
    assert (
        n.index("model-smollm2-int4-a-weighted")
        < n.index("model-small.v1-a-weighted")
        < n.index("model-smollm2-bf16-b-weighted")
        < n.index("default-service-llm-weighted-openai")
    )
    for route, name in (
        ("model-smollm2-int4-a-weighted", "smollm2-int4"),
        ("model-small.v1-a-weighted", "small.v1"),
        ("model-smollm2-int4-a-orca-refused", "smollm2-int4"),
    ):
        r = rs[n.index(route)]
        assert model_match(r) == (name, True)  # exact, any case
    assert rs[n.index("model-small.v1-a-weighted")].route.host_rewrite_literal == "a"
    assert rs[n.index("model-smollm2-bf16-b-weighted")].route.host_rewrite_literal == "b"
    # the default service declares no model: OpenAI calls naming another go to it, gRPC 404s
    assert "unknown-model-grpc" in n and "unknown-model" not in n


def test_unknown_models_get_404s_that_reach_no_cluster() -> None:
    rs = unmatched(a={"model": "x"}, b={"model": "y"})
    by = {r.name: r for r in rs}
    for name in ("unknown-model", "unknown-model-grpc"):
        r = by[name]
        assert r.direct_response.status == 404 and not r.HasField("route")
        assert [h.name for h in r.match.headers] == ["x-meshlm-model"]
        assert r.match.headers[0].present_match
    g = by["unknown-model-grpc"]
    assert g.match.HasField("grpc")
    assert [(h.header.key, h.header.value) for h in g.response_headers_to_add] == [
        ("grpc-status", "5")
    ]
    err = by["unknown-model"].direct_response.body_format
    assert err.content_type == "application/json"
    fields = err.json_format.fields["error"].struct_value.fields
    assert fields["code"].string_value == "model_not_found"
    assert "%REQ(x-meshlm-model)%" in fields["message"].string_value
    assert names(rs).index("unknown-model") < names(rs).index("no-service")


def test_v1_models_lists_every_name_of_the_mesh() -> None:
    rs = unmatched(a={"model": "x", "aliases": ["x2"]}, b={"model": "y"})
    by = {r.name: r for r in rs}
    listed = json.loads(by["models-list"].direct_response.body.inline_string)
    assert [(d["id"], d["owned_by"]) for d in listed["data"]] == [
        ("x", "a"),
        ("x2", "a"),
        ("y", "b"),
    ]
    assert by["models-list"].match.path == "/v1/models"
    assert json.loads(by["models-x2"].direct_response.body.inline_string)["id"] == "x2"
    assert by["models-unknown"].direct_response.status == 404
    # before every route that could send it to a runtime
    assert names(rs).index("models-unknown") < names(rs).index("model-x-a-weighted")


def test_the_no_service_404_names_the_models_where_there_are_some() -> None:
    (plain,) = [r for r in unmatched(a={}, b={}) if r.name == "no-service"]
    assert "model" not in plain.direct_response.body.inline_string
    (by,) = [
        r for r in unmatched(a={"model": "x", "aliases": ["x2"]}, b={}) if r.name == "no-service"
    ]
    assert "name one of its models in the request's model (x, x2)" in (
        by.direct_response.body.inline_string
    )


def test_many_long_aliases_use_no_regex() -> None:
    # An RE2 alternation of these exceeds Envoy's program size limit: the routes would be NACKed.
    aliases = [f"org-{i}/some-long-model-name-{i}:q4_1" for i in range(20)]
    rs = unmatched(a={"model": "m" * 128, "aliases": aliases})
    matchers = [h for r in rs for h in r.match.headers if h.name == "x-meshlm-model"]
    assert not any(h.string_match.HasField("safe_regex") for h in matchers)
    assert {h.string_match.exact for h in matchers if h.string_match.exact} == {"m" * 128, *aliases}

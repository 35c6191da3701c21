"""Authorization by workload identity (issue 14, item 3) without Envoy: the mesh file's
`callers`, what they compile to (Envoy RBAC, the Wasm filter's configuration), the real
authz.wasm's decisions in the proxy-wasm host, and `meshlm policy test --principal`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as rbac_filter_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2 as wasm_filter_pb2
from google.protobuf import wrappers_pb2

from mesh_common import type_urls as t
from meshlm import cli
from wasm_filters.host import WasmHost
from wasm_filters.policy import CallerRule, PolicyError, compile_filter_config, hash_key
from wasm_filters.policy import parse_policy as parse_tenants
from xds_server.mesh import MeshError, parse_mesh
from xds_server.resources import names
from xds_server.resources.build import build_resources
from xds_server.resources.routes import ORCA_PATH
from xds_server.xds.node import NodeInfo

TD = "td.example"
GEN = "/meshlm.inference.v1.Inference/Generate"
INFO = "/meshlm.inference.v1.Inference/Info"
HEALTH = "/grpc.health.v1.Health/Check"
CHAT = f"spiffe://{TD}/ns/apps/sa/chat"
TENANTS = {"acme": {"key_sha256": hash_key("acme-key"), "allow": ["llm/*"]}}


def mesh_doc(callers: Any = None, *, identity: Any = None, tenants: bool = True) -> dict:
    svc: dict[str, Any] = {"versions": {"v1": {"endpoints": ["127.0.0.1:7000"]}}}
    if callers is not None:
        svc["callers"] = callers
    doc: dict[str, Any] = {"services": {"llm": svc}}
    if identity is not None:
        doc["identity"] = identity
    if tenants:
        doc["tenants"] = TENANTS
    return doc


def mesh(callers: Any = None, **kw: Any):
    return parse_mesh(mesh_doc(callers, identity={"trust_domain": TD}, **kw))


# ---- the mesh file -------------------------------------------------------------------------


def test_callers_parse_with_methods_defaulting_to_all() -> None:
    svc = mesh(
        [{"service_account": "apps/chat", "methods": ["Generate"]}, {"service_account": "b/*"}]
    ).services["llm"]
    assert [(c.service_account, c.methods) for c in svc.callers] == [
        ("apps/chat", ("Generate",)),
        ("b/*", ()),
    ]
    assert mesh().services["llm"].callers is None
    assert mesh([]).services["llm"].callers == ()


@pytest.mark.parametrize(
    ("callers", "identity", "message"),
    [
        ([{"service_account": "chat"}], {}, r"^services\.llm\.callers\[0\]\.service_account: "),
        ([{"service_account": "a/b/c"}], {}, r"callers\[0\]\.service_account: expected NAMESP"),
        ([{"service_account": "*/x"}], {}, r"callers\[0\]\.service_account: "),
        (
            [{"service_account": "a/b", "methods": ["Tokenize"]}],
            {},
            r"^services\.llm\.callers\[0\]\.methods\[0\]: unknown method 'Tokenize' \(methods: ",
        ),
        ([{"service_account": "a/b", "methods": []}], {}, r"callers\[0\]\.methods: expected"),
        ([{"service_account": "a/b", "verbs": ["x"]}], {}, r"callers\[0\]\.verbs: unknown field"),
        (
            [{"service_account": "a/b"}, {"service_account": "a/b"}],
            {},
            r"callers\[1\]\.service_account: a/b is listed twice",
        ),
        ({"service_account": "a/b"}, {}, r"^services\.llm\.callers: expected a list"),
        ([{"service_account": "a/b"}], None, r"^services\.llm\.callers: needs an `identity` blo"),
        ([], None, r"^services\.llm\.callers: needs an `identity` block"),
        ([{"service_account": "a/b"}], {"mtls": "off"}, r"^services\.llm\.callers: needs mTLS"),
    ],
)
def test_bad_callers_are_refused_naming_the_field(callers, identity, message) -> None:
    with pytest.raises(MeshError, match=message):
        parse_mesh(mesh_doc(callers, identity=identity))


# ---- compiled: Envoy RBAC and the Wasm filter's configuration ------------------------------


def inbound(m) -> dict:
    return build_resources(m, NodeInfo(service="llm", version="v1", inbound_port=9000))


def http_filters(res: dict) -> list:
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )

    (listener,) = res[t.LISTENER].values()
    hcm = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return list(hcm.http_filters)


def rbac_of(res: dict) -> rbac_filter_pb2.RBAC:
    f = next(f for f in http_filters(res) if f.name == "meshlm.callers")
    cfg = rbac_filter_pb2.RBAC()
    f.typed_config.Unpack(cfg)
    return cfg


def wasm_config(res: dict) -> dict:
    ext = res[t.EXTENSION_CONFIG][names.AUTHZ_FILTER]
    wasm = wasm_filter_pb2.Wasm()
    ext.typed_config.Unpack(wasm)
    sv = wrappers_pb2.StringValue()
    wasm.config.configuration.Unpack(sv)
    return json.loads(sv.value)


def test_callers_compile_to_rbac_policies_first_on_the_inbound_listener() -> None:
    res = inbound(
        mesh(
            [{"service_account": "apps/chat", "methods": ["Generate"]}, {"service_account": "b/*"}]
        )
    )
    assert [f.name for f in http_filters(res)] == [
        "meshlm.callers",
        names.AUTHZ_FILTER,
        "envoy.filters.http.fault",
        "envoy.filters.http.router",
    ]
    rules = rbac_of(res).rules
    assert rules.action == rules.ALLOW
    chat, batch = rules.policies["caller:apps/chat"], rules.policies["caller:b/*"]
    assert chat.principals[0].authenticated.principal_name.exact == CHAT
    assert batch.principals[0].authenticated.principal_name.prefix == f"spiffe://{TD}/ns/b/sa/"
    paths = [p.url_path.path.exact for p in chat.permissions[0].or_rules.rules]
    assert GEN in paths and INFO not in paths and HEALTH in paths
    assert batch.permissions[0].any
    # The ORCA route skips the tenant filters (Envoy sends no key on it), but only the listed
    # workloads' sidecars may open it, whatever methods they may call.
    (rc,) = res[t.ROUTE].values()
    orca = rc.virtual_hosts[0].routes[0]
    assert orca.match.path == ORCA_PATH
    per_route = rbac_filter_pb2.RBACPerRoute()
    assert orca.typed_per_filter_config["meshlm.callers"].Unpack(per_route)
    (policy,) = per_route.rbac.rules.policies.values()
    assert per_route.rbac.rules.action == rules.ALLOW and policy.permissions[0].any
    names_ = [p.authenticated.principal_name for p in policy.principals]
    assert [n.exact or n.prefix for n in names_] == [CHAT, f"spiffe://{TD}/ns/b/sa/"]
    disabled = route_components_pb2.FilterConfig()
    assert orca.typed_per_filter_config[names.AUTHZ_FILTER].Unpack(disabled) and disabled.disabled


def test_no_callers_no_rbac_and_empty_callers_an_rbac_that_allows_nobody() -> None:
    assert "meshlm.callers" not in [f.name for f in http_filters(inbound(mesh()))]
    rules = rbac_of(inbound(mesh([]))).rules
    assert rules.action == rules.ALLOW and not rules.policies
    # Without tenants there is no key check, and the workload check stands alone.
    alone = inbound(mesh([{"service_account": "apps/chat"}], tenants=False))
    assert [f.name for f in http_filters(alone)] == [
        "meshlm.callers",
        "envoy.filters.http.fault",
        "envoy.filters.http.router",
    ]


def test_native_authz_gets_the_workload_check_first_too(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("acme: acme-key\n")
    doc = mesh_doc([{"service_account": "apps/chat"}], identity={"trust_domain": TD})
    doc["authz"] = {"mode": "native", "keys_file": str(keys)}
    res = inbound(parse_mesh(doc))
    assert [f.name for f in http_filters(res)][:2] == [
        "meshlm.callers",
        "envoy.filters.http.header_mutation",
    ]
    assert rbac_of(res).rules.policies["caller:apps/chat"].permissions[0].any


def test_the_wasm_filter_gets_the_callers_and_reads_the_peer_only_with_identity() -> None:
    cfg = wasm_config(inbound(mesh([{"service_account": "apps/chat", "methods": ["Info"]}])))
    assert cfg["peer_identity"] is True
    (rule,) = cfg["callers"]
    assert rule["name"] == "apps/chat" and rule["principal"] == CHAT
    assert INFO in rule["paths"] and GEN not in rule["paths"]
    assert (
        "callers" not in wasm_config(inbound(mesh()))
        and wasm_config(inbound(mesh()))["peer_identity"]
    )
    plain = wasm_config(inbound(parse_mesh(mesh_doc())))
    assert "peer_identity" not in plain and "callers" not in plain
    off = parse_mesh(mesh_doc(identity={"mtls": "off"}))
    assert "peer_identity" not in wasm_config(inbound(off))


def test_client_sent_principal_header_is_stripped_before_any_filter() -> None:
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )
    from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
        header_mutation_pb2 as early_pb2,
    )

    # An identity mesh without tenants or callers: nothing would overwrite a client's copy.
    (listener,) = inbound(parse_mesh(mesh_doc(identity={}, tenants=False)))[t.LISTENER].values()
    hcm = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    (ext,) = hcm.early_header_mutation_extensions
    mut = early_pb2.HeaderMutation()
    ext.typed_config.Unpack(mut)
    assert "x-meshlm-principal" in [x.remove for x in mut.mutations]


def test_compile_refuses_caller_rules_without_the_peer_identity() -> None:
    with pytest.raises(PolicyError, match=r"^callers: "):
        compile_filter_config(
            parse_tenants(TENANTS), service="llm", callers=[CallerRule("a/b", CHAT)]
        )
    with pytest.raises(PolicyError, match=r"^callers\[0\]\.principal: "):
        compile_filter_config(
            parse_tenants(TENANTS),
            service="llm",
            peer_identity=True,
            callers=[CallerRule("a/b", "apps/chat")],
        )


# ---- the real filter's decisions -----------------------------------------------------------


def host_for(callers: list[CallerRule] | None, *, peer_identity: bool = True) -> WasmHost:
    h = WasmHost()
    cfg = compile_filter_config(
        parse_tenants(TENANTS), service="llm", peer_identity=peer_identity, callers=callers
    )
    assert h.configure(cfg)
    return h


RULES = [
    CallerRule("apps/chat", CHAT, (GEN, HEALTH)),
    CallerRule("batch/*", f"spiffe://{TD}/ns/batch/sa/*", None),
]


@pytest.mark.parametrize(
    ("principal", "path", "details"),
    [
        (CHAT, GEN, None),
        (CHAT, GEN + "?q=1", None),
        (CHAT, INFO, "meshlm_authz_caller_forbidden"),
        (f"spiffe://{TD}/ns/batch/sa/nightly", INFO, None),
        (f"spiffe://{TD}/ns/apps/sa/chatty", GEN, "meshlm_authz_unknown_caller"),
        (f"spiffe://{TD}/ns/apps/sa/mail", GEN, "meshlm_authz_unknown_caller"),
        ("spiffe://other.td/ns/apps/sa/chat", GEN, "meshlm_authz_unknown_caller"),
        (None, GEN, "meshlm_authz_unknown_caller"),
    ],
)
def test_filter_decides_on_the_callers_spiffe_id(principal, path, details) -> None:
    d = host_for(RULES).request({"x-api-key": "acme-key"}, path=path, principal=principal)
    if details is None:
        assert d.allowed
        assert d.header("x-meshlm-principal") == principal.encode()
        assert d.header("x-meshlm-tenant") == b"acme"
    else:
        assert (d.allowed, d.status, d.grpc_status, d.details) == (False, 403, 7, details)


def test_an_unlisted_workload_is_denied_before_any_key_check() -> None:
    h = host_for(RULES)
    d = h.request({}, principal=f"spiffe://{TD}/ns/x/sa/y")  # no key: the key check is later
    assert (d.status, d.details) == (403, "meshlm_authz_unknown_caller")
    assert h.metrics["meshlm_authz.denied.missing_key"] == 0
    assert h.metrics["meshlm_authz.denied.unknown_caller"] == 1
    # A listed workload still needs a valid key (both must allow).
    d = h.request({"x-api-key": "stolen"}, principal=CHAT)
    assert (d.status, d.details) == (401, "meshlm_authz_unknown_key")


def test_empty_callers_deny_every_workload_and_absent_callers_none() -> None:
    d = host_for([]).request({"x-api-key": "acme-key"}, principal=CHAT)
    assert (d.status, d.details) == (403, "meshlm_authz_unknown_caller")
    d = host_for(None).request({"x-api-key": "acme-key"}, principal=CHAT)
    assert d.allowed and d.header("x-meshlm-principal") == CHAT.encode()


def test_the_principal_header_is_the_filters_never_the_clients() -> None:
    spoof = [("x-api-key", "acme-key"), ("x-meshlm-principal", "spiffe://td.example/ns/a/sa/b")]
    d = host_for(None).request(spoof, principal=CHAT)
    assert [v for k, v in d.request_headers if k == b"x-meshlm-principal"] == [CHAT.encode()]
    # Without peer_identity (a plaintext mesh) the filter reads no certificate at all.
    d = host_for(None, peer_identity=False).request({"x-api-key": "acme-key"}, principal=CHAT)
    assert d.allowed and d.header("x-meshlm-principal") is None


def test_filter_refuses_caller_rules_it_cannot_apply() -> None:
    base = json.loads(compile_filter_config(parse_tenants(TENANTS), service="llm"))
    for bad in (
        {"callers": [{"name": "a/b", "principal": CHAT}]},  # no peer_identity
        {"peer_identity": True, "callers": [{"name": "a/b", "principal": "apps/chat"}]},
        {"peer_identity": True, "callers": [{"name": "a/b", "principal": "spiffe://*/x"}]},
        {"peer_identity": True, "callers": [{"name": "a/b", "principal": CHAT, "paths": ["x"]}]},
    ):
        h = WasmHost()
        assert not h.configure(json.dumps({**base, **bad})), bad
        assert h.request({"x-api-key": "acme-key"}, principal=CHAT).status == 503


# ---- meshlm policy test --principal --------------------------------------------------------


def policy_test(tmp_path: Path, capsys, *args: str) -> tuple[int, dict]:
    f = tmp_path / "mesh.yaml"
    doc = mesh_doc(
        [{"service_account": "apps/chat", "methods": ["Generate"]}],
        identity={"trust_domain": TD},
    )
    f.write_text(yaml.safe_dump(doc))
    rc = cli.main(["policy", "test", "--mesh", str(f), "--key", "acme-key", *args])
    return rc, json.loads(capsys.readouterr().out)


def test_policy_test_explains_the_workload_and_the_tenant_halves(tmp_path, capsys) -> None:
    rc, out = policy_test(tmp_path, capsys, "--principal", CHAT)
    assert rc == 0 and out["decision"] == "allow"
    assert out["workload"] == {"principal": CHAT, "check": "allow", "rule": "apps/chat"}
    assert out["tenant"] == "acme" and out["tenant_check"] == "allowed"

    rc, out = policy_test(tmp_path, capsys, "--principal", CHAT, "--path", INFO)
    assert rc == 1 and out["grpc_status"] == "PERMISSION_DENIED"
    assert out["workload"]["rule"] == "apps/chat" and out["workload"]["check"] == "deny"
    assert "does not allow this method" in out["workload"]["why"]
    assert out["tenant_check"] == "not reached"

    rc, out = policy_test(tmp_path, capsys, "--principal", f"spiffe://{TD}/ns/x/sa/y")
    assert rc == 1 and out["workload"]["why"] == "no rule names it"
    assert out["message"] == "workload may not call this service"

    rc, out = policy_test(tmp_path, capsys)  # no certificate
    assert rc == 1 and out["workload"]["why"] == "no certificate (plaintext)"

    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(mesh_doc()))
    assert cli.main(["policy", "test", "--mesh", str(plain), "--key", "acme-key"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["check"].startswith("none (the mesh has no identity")


def test_policy_test_names_a_bad_callers_field(tmp_path, capsys) -> None:
    f = tmp_path / "mesh.yaml"
    f.write_text(yaml.safe_dump(mesh_doc([{"service_account": "a/b", "methods": ["Nope"]}])))
    assert cli.main(["policy", "test", "--mesh", str(f), "--principal", CHAT]) == 2
    assert "services.llm.callers[0].methods[0]: unknown method" in capsys.readouterr().err

"""The mesh file: validated on load, every error names the field; mutations stay valid."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from xds_server.mesh import METHODS, MeshError, load_mesh, parse_duration, parse_mesh

BASE = {
    "control_plane": {"grpc_port": 18000, "admin_port": 18001, "debounce": "100ms"},
    "services": {
        "llm": {
            "versions": {
                "v1": {"precision": "bf16", "endpoints": ["127.0.0.1:50051"]},
                "v2": {"precision": "int4", "endpoints": ["127.0.0.1:50052"]},
            },
            "route": {
                "weights": {"v1": 100, "v2": 0},
                "hash_policy": {"header": "x-meshlm-tenant"},
            },
            "outlier_detection": {"consecutive_gateway_failure": 5, "interval": "5s"},
            "circuit_breakers": {"max_requests": 64, "retry_budget": {"budget_percent": 20}},
            "retry_policy": {"retry_on": "unavailable,connect-failure", "num_retries": 1},
        }
    },
    "rollouts": {
        "llm": {"stable": "v1", "canary": "v2", "steps": [5, 25, 50, 100], "interval": "10s"}
    },
}


def _with(path: str, value: object) -> dict:
    raw = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = raw
    for p in parents:
        node = node[p]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return raw


_DELETE = object()


def test_a_good_mesh_loads() -> None:
    mesh = parse_mesh(BASE)
    svc = mesh.services["llm"]
    assert svc.route.weights == {"v1": 100, "v2": 0}
    assert svc.versions["v2"].precision == "int4"
    assert svc.outlier_detection.interval == 5.0
    assert mesh.control_plane.debounce == pytest.approx(0.1)
    assert mesh.rollouts["llm"].steps == (5, 25, 50, 100)
    assert mesh.authz.mode == "none"


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (
            "services.llm.route.weights",
            {"v1": 50, "v3": 50},
            r"services\.llm\.route\.weights\.v3: unknown version \(known: v1, v2\)",
        ),
        (
            "services.llm.route.weights",
            {"v1": 50, "v2": 20},
            r"services\.llm\.route\.weights: weights must sum to 100, got 70",
        ),
        (
            "services.llm.route.weights",
            {"v1": 101},
            r"services\.llm\.route\.weights\.v1: expected an integer 0\.\.100",
        ),
        (
            "services.llm.versions.v1.endpoints",
            ["127.0.0.1"],
            r"services\.llm\.versions\.v1\.endpoints\[0\]: expected host:port",
        ),
        (
            "services.llm.versions.v1.endpoints",
            ["127.0.0.1:x"],
            r"endpoints\[0\]: port 'x' is not a number",
        ),
        ("services.llm.versions.v1.precision", "fp8", r"services\.llm\.versions\.v1\.precision"),
        (
            "services.llm.outlier_detection.interval",
            "5 parsecs",
            r"services\.llm\.outlier_detection\.interval: expected a duration",
        ),
        (
            "services.llm.retry_policy.retry_on",
            "unavailable,sometimes",
            r"services\.llm\.retry_policy\.retry_on: unknown condition 'sometimes'",
        ),
        (
            "services.llm.circuit_breakers.retry_budget",
            {"budget_percent": 120},
            r"retry_budget\.budget_percent: expected 0\.\.100",
        ),
        ("services.llm.colour", "blue", r"services\.llm\.colour: unknown field"),
        ("rollouts.llm.steps", [5, 50, 25], r"rollouts\.llm\.steps\[2\]: steps must be ascending"),
        ("rollouts.llm.steps", [0, 50], r"rollouts\.llm\.steps\[0\]: 0 out of range"),
        ("rollouts.llm.canary", "v9", r"rollouts\.llm\.canary: unknown version 'v9'"),
        ("control_plane.debounce", "soon", r"control_plane\.debounce: expected a duration"),
        (
            "services.llm.route",
            _DELETE,
            r"services\.llm\.route\.weights: required when a service has several versions",
        ),
    ],
)
def test_errors_name_the_field(path: str, value: object, message: str) -> None:
    with pytest.raises(MeshError, match=message):
        parse_mesh(_with(path, value))


def test_authz_needs_tenants_and_a_known_mode() -> None:
    with pytest.raises(MeshError, match=r"authz\.mode: wasm needs a tenants section"):
        parse_mesh({**BASE, "authz": {"mode": "wasm"}})
    with pytest.raises(MeshError, match=r"authz\.mode: expected one of"):
        parse_mesh({**BASE, "authz": {"mode": "maybe"}})


def test_mutations_validate_and_leave_the_original_alone() -> None:
    mesh = parse_mesh(BASE)
    new = mesh.with_weights("llm", {"v1": 90, "v2": 10})
    assert new.services["llm"].route.weights == {"v1": 90, "v2": 10}
    assert mesh.services["llm"].route.weights == {"v1": 100, "v2": 0}
    added = mesh.with_endpoint("llm", "v1", "127.0.0.1:50061", add=True)
    assert [str(e) for e in added.services["llm"].versions["v1"].endpoints] == [
        "127.0.0.1:50051",
        "127.0.0.1:50061",
    ]
    with pytest.raises(
        MeshError, match=r"services\.llm\.versions\.v1\.endpoints: 127\.0\.0\.1:9 is not"
    ):
        mesh.with_endpoint("llm", "v1", "127.0.0.1:9", add=False)
    with pytest.raises(MeshError, match=r"services\.nope: unknown service"):
        mesh.with_weights("nope", {"v1": 100})


def test_durations() -> None:
    assert parse_duration("100ms", "x") == pytest.approx(0.1)
    assert parse_duration("5s", "x") == 5.0
    assert parse_duration("1.5m", "x") == 90.0
    with pytest.raises(MeshError, match=r"^x: "):
        parse_duration("-1s", "x")


def test_bad_yaml_file_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "mesh.yaml"
    p.write_text("services: [unclosed\n")
    with pytest.raises(MeshError, match="not valid YAML"):
        load_mesh(p)


def test_example_mesh_loads() -> None:
    mesh = load_mesh(Path(__file__).resolve().parent.parent / "examples" / "mesh.yaml")
    assert set(mesh.services["llm"].versions) == {"v1", "v2"}
    assert mesh.tenants


def test_the_example_rollout_progresses_at_calls_sent_by_hand() -> None:
    """At ~2.5 calls/s every analysed step sees min_requests canary calls per interval, with
    room: the expected count is at least 1.8 x min_requests (a Poisson shortfall is then rare,
    and costs an interval, never the rollout)."""
    mesh = load_mesh(Path(__file__).resolve().parent.parent / "examples" / "mesh.yaml")
    ro = mesh.rollouts["llm"]
    need = ro.gates["min_requests"]
    for step in ro.steps[:-1]:  # the last step is the promotion, not analysed
        assert 2.5 * ro.interval * step / 100 >= 1.8 * need, (step, ro.interval, need)


# -- issue 9 defect 13: one strict validator at load ---------------------------------------

DUPLICATED = """\
services:
  llm:
    versions:
      v1: {endpoints: ["127.0.0.1:50051"]}
  llm:
    versions:
      v9: {endpoints: ["127.0.0.1:50059"]}
"""


def test_a_duplicate_yaml_key_is_refused_naming_key_and_line(tmp_path: Path) -> None:
    p = tmp_path / "mesh.yaml"
    p.write_text(DUPLICATED)
    with pytest.raises(
        MeshError, match=r"^services\.llm: duplicate key 'llm' at line 5 \(first at line 2\)"
    ):
        load_mesh(p)
    acme = "  acme: {key_sha256: %s, allow: [llm/*]}\n" % ("a" * 64)
    services = "services: {llm: {versions: {v1: {endpoints: [127.0.0.1:50051]}}}}\n"
    p.write_text(services + "tenants:\n" + acme + acme)
    with pytest.raises(
        MeshError, match=r"^tenants\.acme: duplicate key 'acme' at line 4 \(first at line 3\)"
    ):
        load_mesh(p)


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("lm/*", r"tenants\.acme\.allow\[0\]: 'lm/\*' matches no service \(services: llm\)"),
        ("llm/Generat", r"tenants\.acme\.allow\[0\]: 'llm/Generat' matches no method"),
        ("*/Tokenize", r"tenants\.acme\.allow\[0\]: '\*/Tokenize' matches no method"),
    ],
)
def test_allow_rules_that_match_nothing_are_refused(rule: str, message: str) -> None:
    raw = {**BASE, "tenants": {"acme": {"key_sha256": "a" * 64, "allow": [rule]}}}
    with pytest.raises(MeshError, match=message):
        parse_mesh(raw)
    roles = {**raw, "roles": {"reader": [rule]}}
    roles["tenants"] = {"acme": {"key_sha256": "a" * 64, "roles": ["reader"]}}
    with pytest.raises(MeshError, match=r"^roles\.reader\[0\]: "):
        parse_mesh(roles)
    good = {"acme": {"key_sha256": "a" * 64, "allow": ["llm/*", "*/Gen*", "llm/Info"]}}
    assert parse_mesh({**BASE, "tenants": good}).tenants


def test_known_methods_are_the_wire_schema_methods() -> None:
    fbs = Path(__file__).resolve().parent.parent / "schemas" / "inference.fbs"
    declared = re.findall(r"^//\s+/meshlm\.inference\.v1\.Inference/(\w+)", fbs.read_text(), re.M)
    assert tuple(declared) == METHODS


def test_unknown_gate_names_fail_at_load_naming_the_field() -> None:
    raw = _with("rollouts.llm.gates", {"ttft_p99_maxx": "800ms"})
    with pytest.raises(MeshError, match=r"^rollouts\.llm\.gates\.ttft_p99_maxx: unknown gate"):
        parse_mesh(raw)
    with pytest.raises(MeshError, match=r"^rollouts\.llm\.gates\.min_requests: "):
        parse_mesh(_with("rollouts.llm.gates", {"min_requests": -1}))


@pytest.mark.parametrize("endpoint", ["localhost:50051", "foo:1", "llm.default.svc:50051"])
def test_hostname_endpoints_fail_at_load(endpoint: str) -> None:
    raw = _with("services.llm.versions.v1.endpoints", ["127.0.0.1:50051", endpoint])
    with pytest.raises(
        MeshError, match=r"^services\.llm\.versions\.v1\.endpoints\[1\]: .* is not an IPv4 address"
    ):
        parse_mesh(raw)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (
            "services.llm.versions.v2.metrics_urls",
            ["file:///etc/passwd"],
            r"^services\.llm\.versions\.v2\.metrics_urls\[0\]: only http and https",
        ),
        (
            "caller_sidecars",
            [{"admin_url": "ftp://127.0.0.1:15000"}],
            r"^caller_sidecars\[0\]\.admin_url: only http and https",
        ),
        (
            "caller_sidecars",
            [{"admin_url": "http://u:pw@127.0.0.1:15000"}],
            r"^caller_sidecars\[0\]\.admin_url: credentials in a URL",
        ),
        (
            "caller_sidecars",
            [{"admin": "http://127.0.0.1:15000"}],
            r"^caller_sidecars\[0\]\.admin: unknown field",
        ),
    ],
)
def test_gate_source_urls_are_validated(path: str, value: object, message: str) -> None:
    with pytest.raises(MeshError, match=message):
        parse_mesh(_with(path, value))


def test_gate_sources_load() -> None:
    raw = _with("caller_sidecars", [{"admin_url": "http://127.0.0.1:15000"}])
    raw["services"]["llm"]["versions"]["v2"]["metrics_urls"] = ["http://127.0.0.1:9102/metrics"]
    mesh = parse_mesh(raw)
    assert [c.admin_url for c in mesh.caller_sidecars] == ["http://127.0.0.1:15000"]
    assert mesh.services["llm"].versions["v2"].metrics_urls == ("http://127.0.0.1:9102/metrics",)

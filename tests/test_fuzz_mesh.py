"""Hostile mesh files: random YAML structures and mutations of a valid mesh always end in a
MeshError naming a field, never another exception; a bad mesh pushed to a running control plane
changes nothing."""

from __future__ import annotations

import copy
import re

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshlm.demo.launcher import demo_mesh
from xds_server.compose import build_server
from xds_server.mesh import Mesh, MeshError, load_yaml, parse_mesh

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
VALID = demo_mesh()
for _v in VALID["services"]["llm"]["versions"].values():
    _v["endpoints"] = ["127.0.0.1:50051"]
# A field path: `services.llm.route.weights.v3`, `tenants.acme.allow[0]`, `mesh`, a file name.
FIELD = re.compile(r"^[^\s:][^:]*: .+", re.S)

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["100ms", "5s", "-1s", "1e9h", "v1", "127.0.0.1:1",
                                           "llm/*", "a" * 300, "0", "", "🦙"]),
)  # fmt: skip
KEYS = st.one_of(st.text(max_size=10), st.sampled_from(
    ["services", "versions", "route", "weights", "tenants", "rollouts", "v1", "v2", "llm",
     "endpoints", "steps", "gates", "allow", "key_sha256", "authz", "mode", "control_plane"]),
    st.integers(), st.booleans(), st.none())  # fmt: skip
TREES = st.recursive(
    SCALARS,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(KEYS, kids, max_size=4)),
    max_leaves=20,
)


def _parse_or_mesh_error(raw: object) -> Mesh | None:
    try:
        return parse_mesh(raw)
    except MeshError as e:
        assert FIELD.match(str(e)), f"the error must name a field: {e}"
        return None


@FUZZ
@given(TREES)
def test_random_structures(raw: object) -> None:
    _parse_or_mesh_error(raw)
    _parse_or_mesh_error({"services": raw})
    _parse_or_mesh_error({"services": {"llm": raw}})


def _paths(node: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


PATHS = [p for p in _paths(VALID) if p]


@FUZZ
@given(st.sampled_from(PATHS), st.sampled_from(["replace", "delete", "add"]), TREES)
def test_mutated_valid_mesh(path: tuple, op: str, junk: object) -> None:
    raw = copy.deepcopy(VALID)
    parent = raw
    for k in path[:-1]:
        parent = parent[k]
    last = path[-1]
    if op == "replace":
        parent[last] = junk
    elif op == "delete":
        del parent[last]
    elif isinstance(parent, dict):
        parent[f"x_{last}"] = junk
    else:
        parent.append(junk)
    _parse_or_mesh_error(raw)


@FUZZ
@given(st.text(max_size=200))
def test_random_yaml_text(text: str) -> None:
    try:
        raw = load_yaml(text)
    except MeshError as e:
        assert FIELD.match(str(e)), f"the error must name a field: {e}"
        return
    _parse_or_mesh_error(raw)


VALID_LINES = yaml.safe_dump(VALID, sort_keys=False).splitlines(keepends=True)


@FUZZ
@given(st.integers(0, len(VALID_LINES) - 1), st.integers(0, len(VALID_LINES)))
def test_a_line_repeated_elsewhere(line: int, at: int) -> None:
    """A copied line is a duplicate key (named with its line) or some other field error."""
    lines = list(VALID_LINES)
    lines.insert(at, lines[line])
    try:
        raw = load_yaml("".join(lines))
    except MeshError as e:
        assert FIELD.match(str(e)), f"the error must name a field: {e}"
        return
    _parse_or_mesh_error(raw)


def test_bad_weights_push_nothing() -> None:
    mesh = parse_mesh(VALID)
    with build_server(mesh, debounce=0.01) as cp:
        gen = cp.cache.generation
        for weights in ({"v1": 50}, {"v1": 101, "v2": -1}, {"v3": 100}, {"v1": "100"}, {}):
            try:
                cp.set_weights("llm", weights, timeout=1)
            except MeshError as e:
                assert str(e).startswith("services.llm.route.weights"), e
            else:
                raise AssertionError(f"{weights} was accepted")
        assert cp.cache.generation == gen and cp.mesh == mesh

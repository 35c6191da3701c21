"""A service's `model` and `aliases` in the mesh file: OpenAI model-id shape, unique in the mesh
(case-insensitive), each error naming its field."""

from __future__ import annotations

import pytest

from xds_server.mesh import MeshError, parse_mesh

EP = {"versions": {"v1": {"endpoints": ["127.0.0.1:9"]}}}


def mesh(**services: dict) -> object:
    return parse_mesh({"services": {n: {**EP, **s} for n, s in services.items()}})


def test_model_and_aliases_are_read_as_written() -> None:
    m = mesh(
        a={"model": "smollm2-int4", "aliases": ["Small", "org/smollm2:q4_1"]},
        b={"model": "smollm2-bf16"},
        c={},
    )
    assert m.services["a"].model_names == ("smollm2-int4", "Small", "org/smollm2:q4_1")
    assert m.services["b"].model_names == ("smollm2-bf16",)
    assert m.services["c"].model is None and m.services["c"].model_names == ()


@pytest.mark.parametrize(
    ("services", "error"),
    [
        (
            {"a": {"model": "x", "aliases": ["y", "has space"]}},
            r"^services\.a\.aliases\[1\]: .*'has space'",
        ),
        ({"a": {"model": "é"}}, r"^services\.a\.model: expected a model name"),
        ({"a": {"model": ""}}, r"^services\.a\.model: "),
        ({"a": {"model": "m" * 129}}, r"^services\.a\.model: .*1-128"),
        ({"a": {"model": 7}}, r"^services\.a\.model: .*got 7"),
        ({"a": {"model": "x", "aliases": "y"}}, r"^services\.a\.aliases: expected a list"),
        ({"a": {"aliases": ["y"]}}, r"^services\.a\.aliases: needs a model"),
        (
            {"a": {"model": "x", "aliases": ["y", "X"]}},
            r"^services\.a\.aliases\[1\]: 'X' is already services\.a\.model",
        ),
        (
            {"a": {"model": "x", "aliases": ["shared"]}, "b": {"model": "SHARED"}},
            r"^services\.b\.model: 'SHARED' is already services\.a\.aliases\[0\]",
        ),
        (
            {"a": {"model": "x"}, "b": {"model": "y", "aliases": ["z", "X"]}},
            r"^services\.b\.aliases\[1\]: 'X' is already services\.a\.model",
        ),
    ],
)
def test_bad_or_duplicate_names_name_the_field(services: dict, error: str) -> None:
    with pytest.raises(MeshError, match=error):
        mesh(**services)


def test_the_longest_name_and_every_allowed_character_pass() -> None:
    name = "A-z_0.9:/" + "m" * 119
    assert len(name) == 128
    assert mesh(a={"model": name}).services["a"].model == name

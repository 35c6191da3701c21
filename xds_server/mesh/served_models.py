"""A service's model names: `model: NAME` and `aliases: [NAME, ...]`, the ids an OpenAI or
gRPC caller puts in a request's `model` field. A caller sidecar routes a call whose Host names no
service by that field (xds_server/resources/routes.py), so every name must be unique in the
mesh, compared case-insensitively as the runtime compares them."""

from __future__ import annotations

import re
from typing import Any

from xds_server.mesh.fields import MeshError

# OpenAI's model-id shape; the caller sidecar's classify filter sets x-meshlm-model only for a
# value of this shape (wasm_filters/classify.zig), so a name outside it could never match.
MODEL_NAME = re.compile(r"^[A-Za-z0-9._:/-]{1,128}\Z")


def parse_model_names(d: dict, path: str) -> tuple[str | None, tuple[str, ...]]:
    """(model, aliases) of one service's mapping; (None, ()) when it has no model."""
    model = d.get("model")
    aliases_raw = d.get("aliases")
    if model is None:
        if aliases_raw is not None:
            raise MeshError(f"{path}.aliases: needs a model (the name the aliases stand for)")
        return None, ()
    _check(model, f"{path}.model")
    if aliases_raw is None:
        aliases_raw = []
    if not isinstance(aliases_raw, list):
        raise MeshError(f"{path}.aliases: expected a list of model names, got {aliases_raw!r}")
    seen = {model.lower(): f"{path}.model"}
    for i, alias in enumerate(aliases_raw):
        here = f"{path}.aliases[{i}]"
        _check(alias, here)
        if alias.lower() in seen:
            raise MeshError(f"{here}: {alias!r} is already {seen[alias.lower()]}")
        seen[alias.lower()] = here
    return model, tuple(aliases_raw)


def check_unique_across(services: dict[str, Any]) -> None:
    """No model name or alias names two services (case-insensitive)."""
    owner: dict[str, str] = {}
    for svc in services.values():
        names = ([f"services.{svc.name}.model"] if svc.model else []) + [
            f"services.{svc.name}.aliases[{i}]" for i in range(len(svc.aliases))
        ]
        for where, name in zip(names, svc.model_names, strict=True):
            if name.lower() in owner:
                raise MeshError(f"{where}: {name!r} is already {owner[name.lower()]}")
            owner[name.lower()] = where


def _check(name: Any, path: str) -> None:
    if not isinstance(name, str) or not MODEL_NAME.match(name):
        raise MeshError(
            f"{path}: expected a model name of 1-128 letters, digits and . _ : / -, got {name!r}"
        )

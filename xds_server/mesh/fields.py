"""The mesh file's building blocks: `MeshError`, YAML loading without duplicate keys, and
the typed field readers (durations, ports, rates) whose errors name the field path."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from xds_server.mesh.source_url import url_problem


class MeshError(ValueError):
    """A mesh file that cannot be used; the message names the field."""


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)\Z")


_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*\Z")


def parse_duration(value: Any, path: str) -> float:
    """`100ms`, `5s`, `1.5m`, `0s` -> seconds."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise MeshError(f"{path}: expected a duration like 100ms or 5s, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise MeshError(f"{path}: duration must not be negative")
        return float(value)
    m = _DURATION.match(value.strip())
    if not m:
        raise MeshError(f"{path}: expected a duration like 100ms or 5s, got {value!r}")
    return float(m.group(1)) * _UNIT[m.group(2)]


def load_yaml(text: str | bytes, source: str = "mesh") -> Any:
    """YAML text -> plain data, refusing duplicate keys: YAML would keep only the last one, so a
    second `llm:` or tenant would silently replace the first."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is None:
            return None
        _no_duplicate_keys(node, "", set())
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        for mark in (getattr(e, "context_mark", None), getattr(e, "problem_mark", None)):
            if mark is not None:  # else it names "<byte string>", not the file
                mark.name = source
        raise MeshError(f"{source}: not valid YAML: {e}") from None
    except RecursionError:
        raise MeshError(f"{source}: nested too deeply") from None


def _no_duplicate_keys(node: yaml.Node, path: str, seen: set[int]) -> None:
    if id(node) in seen:  # an alias: its anchor was checked already
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else "?"
            here = f"{path}.{field_name(key)}" if path else field_name(key)
            line = k.start_mark.line + 1
            if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                if (k.tag, key) in first:
                    raise MeshError(
                        f"{here}: duplicate key {key!r} at line {line} (first at line "
                        f"{first[(k.tag, key)]}); YAML would silently keep only the last"
                    )
                first[(k.tag, key)] = line
            _no_duplicate_keys(v, here, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _no_duplicate_keys(item, f"{path}[{i}]", seen)


def read_url(raw: Any, path: str) -> str:
    problem = url_problem(raw)
    if problem:
        raise MeshError(f"{path}: {problem}")
    return raw


def read_optional_port(d: dict, key: str) -> int | None:
    return (
        None if d.get(key) is None else read_port(d[key], f"control_plane.{key}", allow_zero=True)
    )


def read_rate(raw: Any, path: str) -> float:
    """`0.8%` or a fraction like 0.008 -> 0.008; it must be more than 0 and at most 100 %."""
    if isinstance(raw, str) and raw.strip().endswith("%"):
        try:
            value = float(raw.strip()[:-1]) / 100.0
        except ValueError:
            value = None
    elif isinstance(raw, (int, float)) and not isinstance(raw, bool):
        value = float(raw)
    else:
        value = None
    if value is None or not 0.0 < value <= 1.0:  # NaN fails too
        raise MeshError(f"{path}: expected a rate like 0.8% or 0.008 (above 0, at most 100%)"
                        f", got {raw!r}")  # fmt: skip
    return value


def read_positive(raw: Any, path: str) -> float:
    v = parse_duration(raw, path)
    if v <= 0:
        raise MeshError(f"{path}: must be greater than 0")
    return v


def read_mapping(raw: Any, path: str) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise MeshError(f"{path}: expected a mapping, got {type(raw).__name__}")
    for k in raw:
        if not isinstance(k, str):
            raise MeshError(f"{path}: keys must be strings, got {k!r}")
    return raw


def field_name(key: object) -> str:
    """A key as one segment of an error's field path: plain names as they are, anything else
    quoted with its `:` escaped, so the path still ends at the first `: `."""
    if isinstance(key, str) and _NAME.match(key):
        return key
    return json.dumps(str(key)).replace(":", "\\u003a")


def only_known(d: dict, path: str, allowed: set[str]) -> None:
    for k in d:
        if k not in allowed:
            raise MeshError(
                f"{path}.{field_name(k)}: unknown field (allowed: {', '.join(sorted(allowed))})"
            )


def check_name(name: str, path: str) -> None:
    if not _NAME.match(name) or "|" in name:
        if path.endswith(f".{name}"):  # the path ends with the bad name itself: quote it
            path = f"{path[: -len(name) - 1]}.{field_name(name)}"
        raise MeshError(f"{path}: invalid name {name!r} (letters, digits, _ . -)")


def read_int(v: Any, path: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise MeshError(f"{path}: expected an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise MeshError(f"{path}: {v} out of range {lo}..{hi if hi is not None else ''}")
    return v


def read_optional_int(d: dict, key: str, path: str, lo: int) -> int | None:
    return None if d.get(key) is None else read_int(d[key], f"{path}.{key}", lo)


def read_port(v: Any, path: str, *, allow_zero: bool = False) -> int:
    return read_int(v, path, 0 if allow_zero else 1, 65535)


def read_optional(d: dict, key: str, path: str, fn: Any) -> Any:
    if d.get(key) is None:
        return None
    return fn(read_mapping(d[key], f"{path}.{key}"), f"{path}.{key}")

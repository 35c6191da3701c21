"""The control plane's desired state sits below what serves it: the modules it uses (CSDS, health,
replication) never import it, nor the server or the composition root built around it, not even
under TYPE_CHECKING or inside a function; and the CLI builds no part of the control plane
itself."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ABOVE = ("xds_server.control_plane", "xds_server.server", "xds_server.compose")
REPLICA = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "xds_server" / "replica").glob("*.py"))
BELOW = ["xds_server/xds/csds.py", "xds_server/xds/health.py", *REPLICA]


def _imported(path: str) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, wherever it stands."""
    out = []
    for node in ast.walk(ast.parse((ROOT / path).read_text(), path)):
        if isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.lineno, node.module)]
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return out


def test_csds_health_and_replication_do_not_import_the_control_plane() -> None:
    found = [
        f"{path}:{line} imports {module}"
        for path in BELOW
        for line, module in _imported(path)
        if module in ABOVE or module.startswith(tuple(f"{a}." for a in ABOVE))
    ]
    assert not found, found


def test_the_cli_leaves_building_the_control_plane_to_the_composition_root() -> None:
    modules = {module for _, module in _imported("meshlm/commands/xds_server.py")}
    assert "xds_server.compose" in modules
    built_here = {
        "xds_server.control_plane",
        "xds_server.server",
        "xds_server.admin.api",
        "xds_server.rollout.controller",
        "xds_server.slo.loop",
        "xds_server.replica.serve",
        "xds_server.replica.replication",
    }
    assert not modules & built_here, modules & built_here

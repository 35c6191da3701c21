"""Fail on any file-level import cycle in the product packages.

Every import statement counts, wherever it sits: at module level, under ``if TYPE_CHECKING:``,
inside a function. A statement imports the module it names: ``import a.b.c`` and
``from a.b.c import x`` import ``a.b.c``; ``from a.b import c`` imports ``a.b.c`` where that is a
module, else ``a.b`` (its ``__init__.py``). A package's ``__init__.py`` that re-exports its
submodules is not in a cycle with them unless one of them names the package itself. Each strongly
connected component of the graph (Tarjan) with more than one module is printed with one concrete
cycle through it, each step as ``file:line``.

    python tools/import_cycles.py [--root DIR] [PACKAGE ...]

Exit status 1 when a cycle exists, 0 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import sys
from collections import deque
from pathlib import Path

PRODUCT = (
    "meshlm",
    "mesh_common",
    "xds_server",
    "sidecar",
    "model_runtime",
    "wasm_filters",
    "schemas",
)


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the given packages."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base.pop()
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """Project modules that `module` imports -> the line of the first statement doing so."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    edges: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target in modules and target != module:
            edges.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(module, is_package, node.level, node.module)
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else base, node.lineno)
    return edges


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one node, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def one_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, staying inside the component."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child not in members:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if child not in previous:
                previous[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("packages", nargs="*", default=list(PRODUCT))
    args = parser.parse_args(argv)
    modules = module_files(args.root, tuple(args.packages))
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    components = strongly_connected(graph)
    for component in components:
        print(f"import cycle among {len(component)} modules: {', '.join(component)}")
        cycle = one_cycle(graph, component)
        for here, there in itertools.pairwise(cycle):
            where = modules[here].relative_to(args.root)
            print(f"  {where}:{graph[here][there]}: {here} imports {there}")
    if components:
        print(f"{len(components)} import cycle(s) in {', '.join(args.packages)}", file=sys.stderr)
        return 1
    print(f"no import cycles among {len(modules)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())

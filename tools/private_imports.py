"""Fail where a product module imports another module's private name (`from x import _name`).

    python tools/private_imports.py [--root DIR] [PACKAGE ...]

Every import statement counts, wherever it sits. A private name is one with a leading
underscore that is not a dunder; `from . import _module` (a private submodule of the importer's
own package) is allowed. Exit status 1 when one is found.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from import_cycles import PRODUCT, module_files


def private_imports(root: Path, packages: tuple[str, ...]) -> list[str]:
    """`file:line: module imports name from other` for each private name imported."""
    modules = module_files(root, packages)
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if node.module.split(".")[0] not in packages:
                continue
            for alias in node.names:
                name = alias.name
                if not name.startswith("_") or name.startswith("__"):
                    continue
                if f"{node.module}.{name}" in modules:
                    continue  # a private submodule, not a name
                where = path.relative_to(root)
                found.append(f"{where}:{node.lineno}: {module} imports {name} from {node.module}")
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("packages", nargs="*", default=list(PRODUCT))
    args = parser.parse_args(argv)
    found = private_imports(args.root, tuple(args.packages))
    if found:
        print("\n".join(found))
        print(f"{len(found)} private import(s) across modules", file=sys.stderr)
        return 1
    print(f"no private names imported across modules in {', '.join(args.packages)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

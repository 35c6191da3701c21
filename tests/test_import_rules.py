"""The import rules of `make lint` on small package trees written here: tools/import_cycles.py
finds a cycle closed by a TYPE_CHECKING or an in-function import, and prints its steps;
tools/private_imports.py finds a private name imported from another module."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def run(tool: str, root: Path, *packages: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOLS / tool), "--root", str(root), *packages],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_cycle_through_type_checking_and_a_function_fails(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "pkg/__init__.py": '"""A package."""\n',
            "pkg/a.py": """
                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    from pkg.b import B
            """,
            "pkg/b.py": """
                def make():
                    from pkg import c

                    return c
            """,
            "pkg/c.py": "from . import a\n",
            "pkg/d.py": "import pkg.a\n",  # imports into the cycle, not part of it
        },
    )
    done = run("import_cycles.py", tmp_path, "pkg")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "import cycle among 3 modules: pkg.a, pkg.b, pkg.c" in done.stdout
    assert "pkg/a.py:5: pkg.a imports pkg.b" in done.stdout
    assert "pkg/b.py:3: pkg.b imports pkg.c" in done.stdout
    assert "pkg/c.py:1: pkg.c imports pkg.a" in done.stdout
    assert "pkg.d" not in done.stdout


def test_a_package_that_re_exports_its_modules_is_no_cycle(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\nfrom pkg.b import B\n",
            "pkg/a.py": "A = 1\n",
            "pkg/b.py": "from pkg.a import A\n\nB = A\n",
        },
    )
    done = run("import_cycles.py", tmp_path, "pkg")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no import cycles among 3 modules" in done.stdout


def test_a_private_name_from_another_module_fails(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "_secret = 1\n__all__ = []\n",
            "pkg/_impl.py": "",
            "pkg/b.py": """
                from pkg import _impl
                from pkg.a import __all__

                def f():
                    from pkg.a import _secret

                    return _secret, _impl, __all__
            """,
        },
    )
    done = run("private_imports.py", tmp_path, "pkg")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["pkg/b.py:6: pkg.b imports _secret from pkg.a"]

"""The model imports none of its accelerators: model_runtime's modules form no file-level import
cycle (in-function imports count), model.py imports torch and the stdlib alone, and the loader
attaches the native step, native attention and CUDA graphs to the models it builds."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import torch

import model_runtime
from model_runtime.llm.model import ModelArgs, Transformer
from tests.runtime_fixtures import cached_model

ROOT = Path(model_runtime.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_model_runtime_has_no_import_cycle():
    assert _cycle(_graph()) is None


def test_the_model_imports_torch_and_the_stdlib_only():
    model_file = next(p for p in ROOT.rglob("model.py"))
    tops = {name.split(".")[0] for name in _imports(model_file)}
    foreign = {t for t in tops if t != "torch" and t not in sys.stdlib_module_names}
    assert foreign == set()


def test_a_bare_model_runs_in_torch_ops():
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=64, vocab_size=16)
    m = Transformer(args)
    assert m.accelerate is None
    m.resolve("native_step")
    m.resolve("native_attention")
    assert m.native_step is None and m.native_attention is None
    with torch.inference_mode():
        assert m(torch.tensor([[1, 2, 3]])).shape == (1, 16)


def test_the_loader_attaches_the_accelerators():
    from model_runtime.llm import accelerators

    lm = cached_model("bf16")
    assert lm.model.accelerate is accelerators.resolve

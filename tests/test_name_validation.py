"""Names are validated as whole strings: a pattern's `$` also matches before a trailing newline,
so "meshlm-system/control-plane\n" passed as a service account, got a join token past the check
that refuses the control plane's own account, and its certificate's SPIFFE ID parsed as the
control plane's. Real control plane and admin API over HTTPS on loopback."""

from __future__ import annotations

import ast
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.test_identity_support import identity_mesh
from xds_server.admin.api import AdminServer
from xds_server.compose import build_server
from xds_server.identity.ca import parse_spiffe_id
from xds_server.mesh import MeshError, parse_mesh

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("xds_server", "sidecar", "meshlm", "model_runtime", "wasm_filters", "schemas")


def test_token_endpoint_refuses_names_with_a_trailing_newline(tmp_path: Path) -> None:
    with build_server(identity_mesh("127.0.0.1:1")) as cp:
        admin = AdminServer(cp, token="admin-secret-1").start()
        roots = tmp_path / "roots.pem"
        roots.write_bytes(cp.identity.ca.bundle_pem())
        tls = ssl.create_default_context(cafile=str(roots))

        def post(sa: str) -> tuple[int, dict]:
            req = urllib.request.Request(
                f"{admin.url}/identity/tokens",
                data=json.dumps({"service_account": sa}).encode(),
                method="POST",
                headers={"Authorization": "Bearer admin-secret-1"},
            )
            try:
                with urllib.request.urlopen(req, timeout=10, context=tls) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        try:
            for sa in ("meshlm-system/control-plane\n", "default/caller\n", "default/caller\r"):
                status, doc = post(sa)
                assert status == 400, (sa, doc)
                assert "service_account" in doc["error"] and "token" not in doc
            status, doc = post("default/caller")
            assert status == 200 and doc["spiffe_id"].endswith("/ns/default/sa/caller")
            status, doc = post("meshlm-system/control-plane")
            assert status == 400 and "control plane" in doc["error"]
        finally:
            admin.stop()


def test_spiffe_ids_and_mesh_names_are_matched_whole() -> None:
    cp_id = "spiffe://meshlm.local/ns/meshlm-system/sa/control-plane"
    assert parse_spiffe_id(cp_id) == ("meshlm.local", "meshlm-system/control-plane")
    assert parse_spiffe_id(cp_id + "\n") is None
    base = {"services": {"llm": {"versions": {"v1": {"endpoints": ["127.0.0.1:1"]}}}}}
    for bad, field in (
        ({"identity": {"trust_domain": "meshlm.local\n"}}, "identity.trust_domain"),
        ({"services": {"llm": {**base["services"]["llm"], "service_account": "a/b\n"}}},
         "service_account"),
        ({"services": {"llm\n": base["services"]["llm"]}}, "llm"),
    ):  # fmt: skip
        with pytest.raises(MeshError) as e:
            parse_mesh({**base, **bad})
        assert field in str(e.value)


def _patterns(tree: ast.AST):
    """String literals (plain or f-strings' constant tails) given to re.compile/match/search/
    fullmatch as the pattern."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "re"
            and node.func.attr in ("compile", "match", "search", "fullmatch")
            and node.args
        ):
            arg = node.args[0]
            if isinstance(arg, ast.JoinedStr) and arg.values:
                arg = arg.values[-1]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield node.lineno, arg.value


def test_no_pattern_in_the_product_ends_in_dollar() -> None:
    """`$` matches before a final newline; `\\Z` (or fullmatch) only at the end."""
    found = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            for line, pattern in _patterns(ast.parse(path.read_text(), str(path))):
                if pattern.endswith("$") and not pattern.endswith("\\$"):
                    found.append(f"{path.relative_to(ROOT)}:{line}: {pattern!r}")
    assert not found, "\n".join(found)

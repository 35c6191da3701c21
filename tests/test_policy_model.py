"""The policy model: parsing with field-path errors, roles, rotation lists, compiling, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from meshlm import cli
from wasm_filters.policy import PolicyError, compile_filter_config, hash_key, parse_policy

H1, H2 = hash_key("key-one"), hash_key("key-two")
BASE = {
    "acme": {
        "key_sha256": H1,
        "allow": ["llm/*"],
        "rate_limit": {"max_tokens": 40, "tokens_per_fill": 20, "fill_interval": "1s"},
        "priority": "high",
    },
    "free": {
        "key_sha256": [H2],
        "allow": ["llm/Generate"],
        "rate_limit": {"max_tokens": 5, "tokens_per_fill": 1, "fill_interval": "1s"},
        "priority": "low",
    },
}


def with_field(tenant: str, **fields: object) -> dict:
    return {**BASE, tenant: {**BASE[tenant], **fields}}


@pytest.mark.parametrize(
    "tenants,message",
    [
        (
            with_field(
                "acme", rate_limit={"max_tokens": 0, "tokens_per_fill": 1, "fill_interval": "1s"}
            ),
            "tenants.acme.rate_limit.max_tokens: must be a positive integer",
        ),
        (
            with_field(
                "acme", rate_limit={"max_tokens": 1, "tokens_per_fill": 1, "fill_interval": "soon"}
            ),
            "tenants.acme.rate_limit.fill_interval: must be a duration",
        ),
        (
            with_field("acme", rate_limit={"max_tokens": 1, "tokens_per_fill": 1}),
            "tenants.acme.rate_limit.fill_interval: required",
        ),
        (with_field("acme", key_sha256="abc"), "tenants.acme.key_sha256: must be 64 hex digits"),
        (with_field("free", key_sha256=[H2, "zz"]), "tenants.free.key_sha256[1]: must be 64 hex"),
        (with_field("free", key_sha256=H1), "tenants.free.key_sha256: a key hash is also used by"),
        (
            with_field("acme", allow=["llm"]),
            "tenants.acme.allow[0]: 'llm' is not a 'service/method'",
        ),
        (with_field("acme", priority="urgent"), "tenants.acme.priority: must be one of"),
        (with_field("acme", roles=["admin"]), "tenants.acme.roles[0]: unknown role 'admin'"),
        (with_field("acme", alow=["llm/*"]), "tenants.acme.alow: unknown field"),
        ({"bad name": BASE["acme"]}, "tenants.bad name: tenant names are"),
        ({"acme": {"allow": ["llm/*"]}}, "tenants.acme.key_sha256: required"),
        (["acme"], "tenants: must be a mapping"),
    ],
)
def test_bad_policies_name_the_field(tenants: object, message: str) -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy(tenants)
    assert str(e.value).startswith(message), str(e.value)


def test_roles_rotation_lists_and_durations() -> None:
    roles = {"reader": ["llm/Tokenize", "search/*"]}
    p = parse_policy(
        with_field("free", roles=["reader"], key_sha256=[H2, H2.upper(), hash_key("k3")]),
        roles=roles,
    )
    free = p.tenant("free")
    assert free.allow == ("llm/Generate", "llm/Tokenize", "search/*")
    assert free.key_sha256 == (H2, hash_key("k3"))  # normalised and de-duplicated
    assert p.methods_for(free, "llm") == ["Generate", "Tokenize"]
    assert p.methods_for(free, "search") == ["*"]
    assert p.methods_for(p.tenant("acme"), "search") == []
    ms = parse_policy(
        with_field(
            "acme", rate_limit={"max_tokens": 1, "tokens_per_fill": 1, "fill_interval": "250ms"}
        )
    )
    assert ms.tenant("acme").rate_limit.fill_interval_ms == 250  # type: ignore[union-attr]
    with pytest.raises(PolicyError, match=r"^roles.reader\[0\]"):
        parse_policy(BASE, roles={"reader": ["nope"]})


def test_compiled_config_has_hashes_only_and_is_deterministic() -> None:
    p = parse_policy(BASE)
    raw = compile_filter_config(p, service="llm")
    assert raw == compile_filter_config(parse_policy(BASE), service="llm")
    assert b"key-one" not in raw and H1.encode() in raw
    doc = json.loads(raw)
    assert doc["service"] == "llm" and doc["version"] == 1
    acme = doc["tenants"][0]
    assert acme["allow"] == ["*"] and acme["rate_limit"]["fill_interval_ms"] == 1000
    with pytest.raises(PolicyError, match=r"^service:"):
        compile_filter_config(p, service="no/slash")


def test_empty_policy_is_valid_and_denies_everyone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text("tenants: {}\n")
    assert cli.main(["policy", "test", "--mesh", str(mesh), "--key", "key-one"]) == 1
    assert json.loads(capsys.readouterr().out)["status"] == 401


def test_cli_compile_and_test(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text(yaml.safe_dump({"services": {"llm": {}}, "tenants": BASE}))
    assert cli.main(["policy", "compile", "--mesh", str(mesh), "--service", "llm"]) == 0
    assert json.loads(capsys.readouterr().out)["tenants"][1]["allow"] == ["Generate"]
    gen = "/meshlm.inference.v1.Inference/Generate"
    assert cli.main(["policy", "test", "--mesh", str(mesh), "--key", "key-two", "--path", gen]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decision"] == "allow" and out["tenant"] == "free" and out["priority"] == "low"
    tok = "/meshlm.inference.v1.Inference/Tokenize"
    assert cli.main(["policy", "test", "--mesh", str(mesh), "--key", "key-two", "--path", tok]) == 1
    out = json.loads(capsys.readouterr().out)
    assert (out["status"], out["grpc_status"]) == (403, "PERMISSION_DENIED")
    mesh.write_text(yaml.safe_dump({"tenants": with_field("acme", priority="urgent")}))
    assert cli.main(["policy", "compile", "--mesh", str(mesh)]) == 2
    assert "tenants.acme.priority" in capsys.readouterr().err

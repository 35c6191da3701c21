"""The real authz.wasm on a mirrored copy (issue 18): `:authority` suffixed `-shadow` is
authenticated and authorized like any call (fails closed), is counted apart when denied
(`meshlm_authz.shadow_denied.<reason>`), and passes only while the tenant's bucket has a token,
taking none (the tenant's call was charged where it was served). In the wasmtime proxy-wasm host."""

from __future__ import annotations

import pytest

from tests.test_authz_host import TOK, config, denied
from wasm_filters.host import WasmHost


@pytest.fixture
def host() -> WasmHost:
    h = WasmHost()
    assert h.configure(config())  # acme: a bucket of 3 tokens, 2 per second
    return h


def shadow(key: str, authority: str = "llm-shadow") -> list[tuple[str, str]]:
    return [(":authority", authority), ("x-api-key", key)]


@pytest.mark.parametrize("authority", ["llm-shadow", "llm-shadow:15001", "10.0.0.7-shadow:80"])
def test_a_shadow_takes_no_token_from_the_tenants_bucket(host: WasmHost, authority: str) -> None:
    for _ in range(10):
        d = host.request(shadow("acme-new", authority))
        assert d.allowed
        assert d.header("x-meshlm-tenant") == b"acme"  # verified identity, as any call
        assert d.header("x-api-key") is None
    # the bucket is whole: the tenant's own calls get its 3 tokens, then 429
    got = [host.request({"x-api-key": "acme-new"}).allowed for _ in range(4)]
    assert got == [True, True, True, False]
    assert host.metrics["meshlm_authz.shadow.acme"] == 10
    assert host.metrics["meshlm_authz.allowed.acme"] == 13


@pytest.mark.parametrize("authority", ["llm", "llm:15001", "llm-shadowx", "llm-shadow.mesh:1a"])
def test_any_other_authority_is_charged(host: WasmHost, authority: str) -> None:
    got = [host.request(shadow("acme-new", authority)).allowed for _ in range(4)]
    assert got == [True, True, True, False]
    assert host.metrics["meshlm_authz.shadow.acme"] == 0


def counted(host: WasmHost, prefix: str) -> dict[str, int]:
    return {k: v for k, v in host.metrics.items() if k.startswith(prefix) and v}


def test_a_shadow_is_authenticated_and_authorized_like_any_call(host: WasmHost) -> None:
    assert denied(host.request([(":authority", "llm-shadow")]), 401, 16)
    assert denied(host.request(shadow("nope")), 401, 16)
    assert denied(host.request(shadow("free-key"), path=TOK), 403, 7)  # free: Generate only
    assert denied(host.request(shadow("other-key")), 403, 7)  # allowed on another service
    assert counted(host, "meshlm_authz.shadow.") == {}
    # a denied copy is counted as a copy, never as a denial of a client's call (the demo and the
    # dashboard compare the denial counters with what clients were answered)
    assert counted(host, "meshlm_authz.denied.") == {}
    assert counted(host, "meshlm_authz.shadow_denied.") == {
        "meshlm_authz.shadow_denied.missing_key": 1,
        "meshlm_authz.shadow_denied.unknown_key": 1,
        "meshlm_authz.shadow_denied.forbidden": 2,
    }


def test_a_copy_of_a_tenant_out_of_budget_is_refused_and_takes_no_token(host: WasmHost) -> None:
    assert [host.request({"x-api-key": "acme-new"}).allowed for _ in range(3)] == [True] * 3
    copy = host.request(shadow("acme-new"))
    assert denied(copy, 429, 8)
    assert copy.response_headers["retry-after"] == "1"
    assert host.metrics["meshlm_authz.shadow_denied.rate_limited"] == 1
    assert host.metrics["meshlm_authz.denied.rate_limited.acme"] == 0
    assert host.metrics["meshlm_authz.shadow.acme"] == 0
    host.advance(1)  # a fill of 2 tokens: copies pass and leave both to the tenant's calls
    assert all(host.request(shadow("acme-new")).allowed for _ in range(5))
    assert [host.request({"x-api-key": "acme-new"}).allowed for _ in range(3)] == [
        True,
        True,
        False,
    ]
    assert denied(host.request(shadow("acme-new")), 429, 8)
    assert host.metrics["meshlm_authz.shadow.acme"] == 5
    assert host.metrics["meshlm_authz.shadow_denied.rate_limited"] == 2
    assert host.metrics["meshlm_authz.denied.rate_limited.acme"] == 1


def test_a_shadow_without_a_policy_is_denied() -> None:
    h = WasmHost()
    assert not h.configure(b"{not json")
    assert denied(h.request(shadow("acme-new")), 503, 14)
    assert h.metrics["meshlm_authz.shadow_denied.no_policy"] == 1
    assert h.metrics["meshlm_authz.denied.no_policy"] == 0

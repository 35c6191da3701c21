"""The OpenAI HTTP API through the mesh (issue 17, item 2), with the real `openai` SDK: client ->
caller sidecar (outbound, routes by Host = service) -> inbound sidecar of v1 or v2 (Wasm authz,
route /v1/ to the runtime's HTTP port) -> a real runtime (int4 SmolLM2, `OpenAIServer`). Both
versions' sidecars front the module's one runtime (a model load is slow): which version served
a call is read from the inbound sidecars' counters. The filter's decisions one by one:
tests/test_openai_mesh_authz.py."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import openai
import pytest

from mesh_common.ports import free_port
from model_runtime.serving.client import Client
from model_runtime.serving.faults import Faults
from model_runtime.serving.openai_http import OpenAIServer
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.runtime_fixtures import serving_runtime
from tests.test_xds_support import eventually
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.mesh.rollout_spec import Gates
from xds_server.rollout.gates.direct import evaluate
from xds_server.rollout.gates.envoy_stats import HTTP_5XX, EnvoyStatsSource, delta
from xds_server.rollout.verdict import FAIL
from xds_server.server import XdsServer

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
ANSWER = "The capital of France is Paris."  # greedy (DESIGN.md: the deterministic check)
POISON = [{"role": "user", "content": "Tell me about a dragon."}]  # the runtime fails it: 500
KEYS = {"acme": "acme-openai-key", "gen": "gen-only-key", "tiny": "tiny-tenant-key"}


@dataclass
class Mesh:
    cp: XdsServer
    caller: EnvoyProcess
    inbound: dict[str, EnvoyProcess]  # version -> its inbound sidecar
    outbound_port: int
    model: str

    def client(self, key: str, **headers: str) -> openai.OpenAI:
        # The caller sidecar routes by Host, as gRPC by :authority: the service's name.
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.outbound_port}/v1",
            api_key=key,
            max_retries=0,
            timeout=120,
            default_headers={"Host": "llm", **headers},
        )

    def served(self) -> dict[str, int]:
        """HTTP calls each version's inbound sidecar passed to the runtime so far."""
        out = {}
        for v, envoy in self.inbound.items():
            s = envoy.stats(rf"cluster\.inbound\|llm\|{v}\|http\.upstream_rq_completed")
            out[v] = sum(s.values())
        return out


@pytest.fixture(scope="module")
def mesh(smollm_int4) -> Iterator[Mesh]:
    rt = serving_runtime(smollm_int4, faults=Faults(poison="dragon", poison_action="error"))
    http = OpenAIServer(rt)
    ports = {"v1": free_port(), "v2": free_port()}
    tenants = {
        "acme": {"key_sha256": hash_key(KEYS["acme"]), "allow": ["llm/*"]},
        "gen": {"key_sha256": hash_key(KEYS["gen"]), "allow": ["llm/Generate"]},
        "tiny": {
            "key_sha256": hash_key(KEYS["tiny"]),
            "allow": ["llm/*"],
            "rate_limit": {"max_tokens": 2, "tokens_per_fill": 1, "fill_interval": "60s"},
        },
    }
    doc = {
        "services": {
            "llm": {
                "versions": {v: {"endpoints": [f"127.0.0.1:{p}"]} for v, p in ports.items()},
                "route": {"weights": {"v1": 100, "v2": 0}},
                # Far below any completion's time: it must not reach the HTTP API's calls.
                "retry_policy": {"retry_on": "connect-failure", "per_try_timeout": "50ms"},
            },
            # A service whose only replica is down: the caller sidecar's own 503.
            "down": {"versions": {"v1": {"endpoints": [f"127.0.0.1:{free_port()}"]}}},
        },
        "tenants": tenants,
    }
    cp = build_server(parse_mesh(doc), debounce=0.02).start()
    xds = ("127.0.0.1", cp.grpc_port)
    outbound = free_port()
    envoys: list[EnvoyProcess] = []
    try:
        for v, port in ports.items():
            boot = ads_bootstrap(
                f"runtime-{v}",
                xds_address=xds,
                service="llm",
                version=v,
                inbound_port=port,
                local_endpoint=rt.target,
                local_http_endpoint=f"127.0.0.1:{http.port}",
            )
            envoys.append(EnvoyProcess(boot).start())
        envoys.append(
            EnvoyProcess(ads_bootstrap("caller", xds_address=xds, outbound_port=outbound)).start()
        )
        m = Mesh(
            cp,
            envoys[-1],
            dict(zip(ports, envoys[:2], strict=True)),
            outbound,
            rt.service.model_info.name,
        )
        with m.client(KEYS["acme"]) as c:
            eventually(lambda: c.models.list().data, what="the mesh serves /v1/models")
        yield m
    finally:
        for e in envoys:
            e.stop()
        cp.stop()
        http.stop()
        rt.shutdown(grace=0)


@pytest.fixture(scope="module")
def acme(mesh: Mesh) -> Iterator[openai.OpenAI]:
    with mesh.client(KEYS["acme"]) as c:
        yield c


def test_chat_through_the_mesh_with_a_bearer_key(mesh: Mesh, acme: openai.OpenAI) -> None:
    r = acme.chat.completions.create(
        model=mesh.model, messages=QUESTION, temperature=0, max_tokens=20
    )
    assert r.choices[0].message.content == ANSWER and r.model == mesh.model
    assert r.usage.completion_tokens > 0
    events = acme.chat.completions.create(
        model=mesh.model,
        messages=QUESTION,
        temperature=0,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(events)
    text = "".join(e.choices[0].delta.content or "" for e in chunks if e.choices)
    assert text == ANSWER
    assert chunks[-1].usage == r.usage


def test_a_bad_key_is_a_401_in_openais_shape(mesh: Mesh) -> None:
    with mesh.client("not-a-key") as c, pytest.raises(openai.AuthenticationError) as e:
        c.chat.completions.create(model=mesh.model, messages=QUESTION, max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert e.value.type == "invalid_request_error"


def test_a_method_the_tenant_may_not_call_is_a_403(mesh: Mesh) -> None:
    with mesh.client(KEYS["gen"]) as c:
        assert c.completions.create(model=mesh.model, prompt="Hello", max_tokens=1).choices
        with pytest.raises(openai.PermissionDeniedError) as e:
            c.models.list()  # Info: not among gen's methods
    assert e.value.status_code == 403 and e.value.code == "method_not_allowed"


def test_a_rate_limited_tenant_gets_a_429(mesh: Mesh) -> None:
    with mesh.client(KEYS["tiny"], **{"x-canary": "never"}) as c:
        served = 0
        with pytest.raises(openai.RateLimitError) as e:
            for _ in range(5):
                c.models.list()
                served += 1
    assert served >= 1  # its limit let the first call through
    assert e.value.code == "rate_limit_exceeded" and e.value.response.headers["retry-after"]


def test_a_canary_step_and_x_canary_pins_move_http_calls(mesh: Mesh, acme) -> None:
    def one(client: openai.OpenAI) -> str:
        before = mesh.served()
        client.completions.create(model=mesh.model, prompt="Hi", max_tokens=1)
        after = mesh.served()
        moved = [v for v in after if after[v] > before[v]]
        assert len(moved) == 1, (before, after)
        return moved[0]

    assert one(acme) == "v1"  # weights v1 100 / v2 0
    with mesh.client(KEYS["acme"], **{"x-canary": "always"}) as pinned:
        assert one(pinned) == "v2"
    try:
        assert mesh.cp.set_weights("llm", {"v1": 0, "v2": 100}).ok
        assert {one(acme) for _ in range(3)} == {"v2"}
    finally:
        assert mesh.cp.set_weights("llm", {"v1": 100, "v2": 0}).ok


def test_envoys_own_refusals_are_openai_errors_and_grpc_keeps_its_status(mesh: Mesh) -> None:
    """A 503 (no replica answers) and a 404 (the Host is no service of the mesh) that the
    caller sidecar itself answers come in OpenAI's error shape on /v1/ paths (issue 17); a gRPC
    call meeting the same refusals still gets a trailers-only gRPC status."""
    with mesh.client(KEYS["acme"], Host="down") as c, pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model=mesh.model, messages=QUESTION, max_tokens=2)
    assert e.value.status_code == 503 and e.value.code == "service_unavailable", e.value.body
    assert e.value.type == "server_error" and "upstream connect error" in e.value.message
    with mesh.client(KEYS["acme"], Host="nosuch") as c, pytest.raises(openai.NotFoundError) as e:
        c.models.list()
    assert e.value.code == "no_route" and e.value.type == "invalid_request_error", e.value.body
    assert "nosuch" in e.value.message
    target = f"127.0.0.1:{mesh.outbound_port}"
    for authority, status in (("down", "UNAVAILABLE"), ("nosuch", "UNIMPLEMENTED")):
        client = Client(target, api_key=KEYS["acme"], authority=authority)
        with client, pytest.raises(grpc.RpcError) as g:
            client.info(timeout=30)
        assert g.value.code().name == status, g.value.details()


def test_gates_count_an_http_5xx(mesh: Mesh, acme: openai.OpenAI) -> None:
    src = EnvoyStatsSource([mesh.caller.admin_url], "outbound|llm|v1")
    before = src.read()
    acme.completions.create(model=mesh.model, prompt="Hi", max_tokens=1)
    with pytest.raises(openai.InternalServerError) as e:
        acme.chat.completions.create(model=mesh.model, messages=POISON, max_tokens=2)
    assert e.value.status_code == 500
    got = delta(before, src.read())
    assert got.total == 2 and got.by_status.get(HTTP_5XX) == 1 and got.server_faults == 1
    verdict = evaluate(Gates(grpc_success_rate_min=99.0, min_requests=2), got, None)
    assert verdict.outcome == FAIL and "50.00%" in verdict.reason


def test_a_completion_longer_than_the_per_try_timeout_is_not_cut(mesh: Mesh, acme) -> None:
    """A completion without `stream` sends its headers with the whole answer; the service's
    per_try_timeout (50 ms here) would cut it (504) and a retry would run it again."""
    r = acme.chat.completions.create(
        model=mesh.model, messages=QUESTION, temperature=0, max_tokens=20
    )
    assert r.choices[0].message.content == ANSWER

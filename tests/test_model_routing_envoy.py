"""Routing by model name through one caller endpoint: the openai SDK and gRPC clients call the
caller sidecar with no Host that names a service, and the body's `model` picks the service. Real
Envoys (a caller sidecar, an inbound sidecar per service) in front of two real runtimes: SmolLM2
int4 served as `smollm2-int4` (alias `smollm2-q4`) and bf16 served as `smollm2-bf16`."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import openai
import pytest

from mesh_common.ports import free_port
from model_runtime.serving.client import Client
from model_runtime.serving.openai_http import OpenAIServer
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.runtime_fixtures import serving_runtime
from tests.test_xds_support import eventually
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.server import XdsServer

HI = [{"role": "user", "content": "Hi!"}]
MODELS = {"small": ("smollm2-int4", "smollm2-q4"), "dense": ("smollm2-bf16",)}


@dataclass
class Rig:
    cp: XdsServer
    inbound: dict[str, EnvoyProcess]  # service -> its inbound sidecar
    caller: EnvoyProcess
    outbound_port: int
    services: dict[str, dict]  # the mesh file's services

    def sdk(self, **headers: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.outbound_port}/v1",
            api_key="any-key",  # authz none here: the model is what this test is about
            max_retries=0,
            timeout=120,
            default_headers=headers or None,
        )

    def grpc(self) -> Client:
        # no authority override: :authority is 127.0.0.1:PORT, which names no service
        return Client(f"127.0.0.1:{self.outbound_port}")

    def reached(self) -> dict[str, int]:
        """Requests each service's inbound sidecar sent its runtime (gRPC and HTTP)."""
        out = {}
        for svc, envoy in self.inbound.items():
            s = envoy.stats(rf"cluster\.inbound\|{svc}\|v1(\|http)?\.upstream_rq_total")
            out[svc] = sum(s.values())
        return out

    def sent_upstream(self) -> int:
        """Requests the caller sidecar sent to any service."""
        return sum(self.caller.stats(r"cluster\.outbound\|.*\.upstream_rq_total").values())

    def served_by(self, call: Callable[[], Any]) -> str:
        return self.served(call)[0]

    def served(self, call: Callable[[], Any]) -> tuple[str, Any]:
        """(the service whose runtime got the call, what the call returned)."""
        before = self.reached()
        got = call()
        after = self.reached()
        (moved,) = [s for s in after if after[s] > before[s]]
        return moved, got


@pytest.fixture(scope="module")
def rig(smollm_int4, smollm_bf16) -> Iterator[Rig]:
    runtimes = {
        "small": serving_runtime(smollm_int4, served_model_names=MODELS["small"]),
        "dense": serving_runtime(smollm_bf16, served_model_names=MODELS["dense"]),
    }
    https = {s: OpenAIServer(rt) for s, rt in runtimes.items()}
    ports = {s: free_port() for s in runtimes}
    services = {
        s: {
            "versions": {"v1": {"endpoints": [f"127.0.0.1:{ports[s]}"]}},
            "model": MODELS[s][0],
            "aliases": list(MODELS[s][1:]),
        }
        for s in runtimes
    }
    cp = build_server(parse_mesh({"services": services}), debounce=0.02).start()
    xds = ("127.0.0.1", cp.grpc_port)
    envoys: list[EnvoyProcess] = []
    try:
        inbound = {}
        for s, rt in runtimes.items():
            boot = ads_bootstrap(
                f"{s}-v1",
                xds_address=xds,
                service=s,
                version="v1",
                inbound_port=ports[s],
                local_endpoint=rt.target,
                local_http_endpoint=f"127.0.0.1:{https[s].port}",
            )
            envoys.append(EnvoyProcess(boot).start())
            inbound[s] = envoys[-1]
        outbound_port = free_port()
        caller = ads_bootstrap("caller", xds_address=xds, outbound_port=outbound_port)
        envoys.append(EnvoyProcess(caller).start())
        r = Rig(cp, inbound, envoys[-1], outbound_port, services)
        with r.sdk() as c:
            for names in MODELS.values():
                eventually(
                    lambda n=names[0]: c.chat.completions.create(
                        model=n, messages=HI, max_tokens=1
                    ),
                    60,
                    f"{names[0]} answers through the caller sidecar",
                )
        yield r
    finally:
        for e in envoys:
            e.stop()
        cp.stop()
        for s, rt in runtimes.items():
            https[s].stop()
            rt.shutdown(grace=0)


def test_the_sdk_reaches_each_model_by_name_through_one_endpoint(rig: Rig) -> None:
    with rig.sdk() as c:
        for svc, names in MODELS.items():
            moved, r = rig.served(
                lambda n=names[0]: c.chat.completions.create(model=n, messages=HI, max_tokens=3)
            )
            assert moved == svc
            assert (
                r.model == names[0] and r.choices[0].message.content and r.usage.completion_tokens
            )
        # /v1/completions too
        done = lambda: c.completions.create(model="smollm2-bf16", prompt="Once", max_tokens=2)  # noqa: E731
        assert rig.served_by(done) == "dense"


def test_an_alias_in_any_case_reaches_its_service(rig: Rig) -> None:
    with rig.sdk() as c:
        for name in ("smollm2-q4", "SMOLLM2-Q4", "SmolLM2-INT4"):
            call = lambda n=name: c.chat.completions.create(model=n, messages=HI, max_tokens=1)  # noqa: E731
            assert rig.served_by(call) == "small", name


def test_grpc_generate_reaches_each_model_by_name(rig: Rig) -> None:
    with rig.grpc() as g:
        for svc, names in MODELS.items():
            for name in names:

                def call(n: str = name) -> None:
                    chunks = list(g.generate("Hi", model=n, max_new_tokens=2, timeout=60))
                    assert chunks and chunks[-1].finish_reason != 0

                assert rig.served_by(call) == svc, name


def test_an_unknown_model_gets_404_model_not_found_and_reaches_no_runtime(rig: Rig) -> None:
    before, sent = rig.reached(), rig.sent_upstream()
    assert sent > 0 and sum(before.values()) > 0  # live counters: the fixture's calls count
    with rig.sdk() as c, pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=1)
    assert e.value.code == "model_not_found", e.value.body
    assert e.value.status_code == 404
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"
    assert body["param"] == "model"
    msg = e.value.message
    assert "`gpt-4o`" in msg and "smollm2-int4, smollm2-q4, smollm2-bf16" in msg, msg
    with rig.grpc() as g, pytest.raises(grpc.RpcError) as ge:
        list(g.generate("Hi", model="gpt-4o", max_new_tokens=1, timeout=30))
    assert ge.value.code() == grpc.StatusCode.NOT_FOUND, ge.value
    assert "`gpt-4o`" in (ge.value.details() or ""), ge.value.details()
    assert rig.reached() == before
    assert rig.sent_upstream() == sent  # answered by the caller sidecar itself


def test_v1_models_lists_the_meshs_models(rig: Rig) -> None:
    before = rig.reached()
    with rig.sdk() as c:
        listed = c.models.list().data
        assert [m.id for m in listed] == ["smollm2-int4", "smollm2-q4", "smollm2-bf16"]
        assert {m.id: m.owned_by for m in listed}["smollm2-q4"] == "small"
        assert c.models.retrieve("smollm2-bf16").id == "smollm2-bf16"
        with pytest.raises(openai.NotFoundError) as e:
            c.models.retrieve("gpt-4o")
        assert e.value.code == "model_not_found"
    assert rig.reached() == before  # the caller sidecar answers


def test_a_spoofed_model_header_does_not_override_the_body(rig: Rig) -> None:
    spoof = {"x-meshlm-model": "smollm2-bf16"}
    with rig.sdk(**spoof) as c:
        call = lambda: c.chat.completions.create(model="smollm2-int4", messages=HI, max_tokens=1)  # noqa: E731
        assert rig.served_by(call) == "small"
        # a body without a model it can read routes by no model at all: the header is gone
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model="", messages=HI, max_tokens=1)
        assert e.value.code == "no_route", e.value.body
    with rig.grpc() as g:
        md = [("x-meshlm-model", "smollm2-int4")]
        call = lambda: list(g.generate("Hi", model="smollm2-bf16", max_new_tokens=1, metadata=md))  # noqa: E731
        assert rig.served_by(call) == "dense"


def test_many_long_aliases_are_accepted_by_envoy_and_route(rig: Rig) -> None:
    aliases = [f"org-{i}/smollm2-135m-instruct-alias-{i}:q4_1" for i in range(20)]
    doc = {"services": copy.deepcopy(rig.services)}
    doc["services"]["small"]["aliases"] = aliases
    try:
        assert rig.cp.update_mesh(parse_mesh(doc), timeout=20).ok  # every sidecar ACKed
        with rig.grpc() as g:
            # the runtime refuses names it does not serve: that it answered is the point
            def call() -> None:
                with pytest.raises(grpc.RpcError) as e:
                    list(g.generate("Hi", model=aliases[-1].upper(), max_new_tokens=1, timeout=30))
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
                assert "is not served here" in (e.value.details() or ""), e.value.details()

            assert rig.served_by(call) == "small"
    finally:
        assert rig.cp.update_mesh(parse_mesh({"services": rig.services}), timeout=20).ok


def test_a_default_service_without_a_model_takes_openai_calls_for_names_the_mesh_lacks(
    rig: Rig,
) -> None:
    # `plain` declares no model; its one host is the bf16 runtime's sidecar, reached as `plain`
    doc = {"services": copy.deepcopy(rig.services), "default_service": "plain"}
    doc["services"]["plain"] = {"versions": copy.deepcopy(rig.services["dense"]["versions"])}
    try:
        assert rig.cp.update_mesh(parse_mesh(doc), timeout=20).ok
        with rig.sdk() as c:
            # its runtime, not the caller sidecar, answers a name it does not serve
            def unknown() -> None:
                with pytest.raises(openai.NotFoundError) as e:
                    c.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=1)
                assert "is not served here" in e.value.message, e.value.message

            assert rig.served_by(unknown) == "dense"
            # named models still go by name, and /v1/models is still the mesh's list
            call = lambda: c.chat.completions.create(model="smollm2-q4", messages=HI, max_tokens=1)  # noqa: E731
            assert rig.served_by(call) == "small"
            assert [m.id for m in c.models.list().data] == [*MODELS["small"], *MODELS["dense"]]
        with rig.grpc() as g, pytest.raises(grpc.RpcError) as ge:
            # gRPC never goes to a default service: an unknown model is the mesh's NOT_FOUND
            list(g.generate("Hi", model="gpt-4o", max_new_tokens=1, timeout=30))
        assert "does not exist in this mesh" in (ge.value.details() or "")
    finally:
        assert rig.cp.update_mesh(parse_mesh({"services": rig.services}), timeout=20).ok

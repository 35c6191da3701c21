"""The openai SDK as a user writes it, `OpenAI(base_url=<caller sidecar>/v1, api_key=KEY)` with no
Host header: the caller sidecar sends /v1/ calls whose Host names no service to the mesh's
default service (its only one, or `default_service`), by that service's own weights and
`x-canary` pins; otherwise its 404 names the services and how to pick one. Real Envoys (a caller
sidecar, an inbound sidecar per version) in front of a real runtime's OpenAI HTTP API."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

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
from xds_server.mesh import MeshError, parse_mesh
from xds_server.server import XdsServer

HI = [{"role": "user", "content": "Hi!"}]


@dataclass
class Rig:
    cp: XdsServer
    inbound: dict[str, EnvoyProcess]
    ports: dict[str, int]  # version -> its inbound sidecar's port
    outbound_port: int
    model: str = ""  # the runtime's served name

    def doc(self, **top: object) -> dict:
        versions = {v: {"endpoints": [f"127.0.0.1:{p}"]} for v, p in self.ports.items()}
        llm = {"versions": versions, "route": {"weights": {"v1": 100, "v2": 0}}}
        return {"services": {"llm": llm}, **top}

    def sdk(self, **headers: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.outbound_port}/v1",
            api_key="any-key",  # authz none here: the Host is what this test is about
            max_retries=0,
            timeout=120,
            default_headers=headers or None,
        )

    def served_by(self, client: openai.OpenAI) -> str:
        """Which version's inbound sidecar passed one completion to the runtime."""

        def counts() -> dict[str, int]:
            out = {}
            for v, envoy in self.inbound.items():
                s = envoy.stats(rf"cluster\.inbound\|llm\|{v}\|http\.upstream_rq_completed")
                out[v] = sum(s.values())
            return out

        before = counts()
        r = client.chat.completions.create(model=self.model, messages=HI, max_tokens=2)
        assert r.choices[0].message.content is not None
        after = counts()
        (moved,) = [v for v in after if after[v] > before[v]]
        return moved


@pytest.fixture(scope="module")
def rig(smollm_int4) -> Iterator[Rig]:
    rt = serving_runtime(smollm_int4)
    http = OpenAIServer(rt)
    ports = {"v1": free_port(), "v2": free_port()}
    r = Rig(None, {}, ports, free_port())  # type: ignore[arg-type]
    cp = build_server(parse_mesh(r.doc()), debounce=0.02).start()
    r.cp, r.model = cp, rt.service.model_info.name
    xds = ("127.0.0.1", cp.grpc_port)
    envoys: list[EnvoyProcess] = []
    try:
        for v, port in ports.items():
            boot = ads_bootstrap(
                f"llm-{v}",
                xds_address=xds,
                service="llm",
                version=v,
                inbound_port=port,
                local_endpoint=rt.target,
                local_http_endpoint=f"127.0.0.1:{http.port}",
            )
            envoys.append(EnvoyProcess(boot).start())
            r.inbound[v] = envoys[-1]
        caller = ads_bootstrap("caller", xds_address=xds, outbound_port=r.outbound_port)
        envoys.append(EnvoyProcess(caller).start())
        with r.sdk(Host="llm") as c:
            eventually(lambda: c.models.list().data, 60, "the mesh serves /v1/models")
        yield r
    finally:
        for e in envoys:
            e.stop()
        cp.stop()
        http.stop()
        rt.shutdown(grace=0)


def test_the_sdk_without_a_host_reaches_the_meshs_only_service(rig: Rig) -> None:
    assert rig.cp.update_mesh(parse_mesh(rig.doc()), timeout=20).ok
    with rig.sdk() as c:
        r = c.chat.completions.create(model=rig.model, messages=HI, max_tokens=4)
        assert r.choices[0].message.content and r.usage.completion_tokens > 0
        assert rig.served_by(c) == "v1"


def test_the_default_service_keeps_its_weights_and_canary_pins(rig: Rig) -> None:
    assert rig.cp.update_mesh(parse_mesh(rig.doc()), timeout=20).ok
    with rig.sdk() as plain, rig.sdk(**{"x-canary": "always"}) as pinned:
        assert rig.served_by(pinned) == "v2"
        try:
            assert rig.cp.set_weights("llm", {"v1": 0, "v2": 100}, timeout=20).ok
            assert {rig.served_by(plain) for _ in range(3)} == {"v2"}
        finally:
            assert rig.cp.set_weights("llm", {"v1": 100, "v2": 0}, timeout=20).ok


def test_default_service_picks_one_of_several(rig: Rig) -> None:
    doc = rig.doc(default_service="llm")
    doc["services"]["other"] = {"versions": {"v1": {"endpoints": [f"127.0.0.1:{free_port()}"]}}}
    try:
        assert rig.cp.update_mesh(parse_mesh(doc), timeout=20).ok
        with rig.sdk() as c:
            assert rig.served_by(c) == "v1"
    finally:
        assert rig.cp.update_mesh(parse_mesh(rig.doc()), timeout=20).ok


def test_without_a_default_the_404_names_the_services_and_how_to_pick(rig: Rig) -> None:
    doc = rig.doc()
    doc["services"]["other"] = {"versions": {"v1": {"endpoints": [f"127.0.0.1:{free_port()}"]}}}
    try:
        assert rig.cp.update_mesh(parse_mesh(doc), timeout=20).ok
        with rig.sdk() as c, pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model=rig.model, messages=HI, max_tokens=2)
        msg = e.value.message
        assert e.value.code == "no_route", e.value.body
        assert f"at 127.0.0.1:{rig.outbound_port}" in msg and "services: llm, other" in msg
        assert 'default_headers={"Host": "llm"}' in msg and "default_service" in msg, msg
        # gRPC with an authority that names no service: UNIMPLEMENTED, saying the same.
        target = f"127.0.0.1:{rig.outbound_port}"
        with Client(target, authority="nope") as g, pytest.raises(grpc.RpcError) as ge:
            g.info(timeout=30)
        assert ge.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "services: llm, other" in (ge.value.details() or ""), ge.value.details()
    finally:
        assert rig.cp.update_mesh(parse_mesh(rig.doc()), timeout=20).ok


def test_a_default_service_not_in_the_mesh_names_the_field() -> None:
    doc = {"services": {"llm": {"versions": {"v1": {"endpoints": ["127.0.0.1:9"]}}}}}
    with pytest.raises(MeshError, match=r"^default_service: .*\(llm\), got 'lm'"):
        parse_mesh({**doc, "default_service": "lm"})
    with pytest.raises(MeshError, match=r"^default_service: "):
        parse_mesh({**doc, "default_service": ["llm"]})
    assert parse_mesh(doc).openai_default == "llm"
    two = {"services": {**doc["services"], "b": doc["services"]["llm"]}}
    assert parse_mesh(two).openai_default is None
    assert parse_mesh({**two, "default_service": "b"}).openai_default == "b"

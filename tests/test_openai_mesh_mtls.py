"""The OpenAI HTTP API through a mesh with workload identity (issue 17, item 2 with issue 14):
the hop caller sidecar -> inbound sidecar is mTLS for HTTP calls as for gRPC, and the service's
`callers` (Envoy RBAC, then the Wasm filter) decide on the OpenAI paths by the method they run.
Real Envoys with certificates from the control plane's mesh CA, a real int4 runtime."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from mesh_common.ports import free_port
from model_runtime.serving.openai_http import OpenAIServer
from tests.runtime_fixtures import serving_runtime
from tests.test_identity_support import Sidecar, identity_sidecar, join_token_file, short_dir
from tests.test_xds_support import eventually
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh

TD = "meshlm.local"
KEY = "acme-openai-key"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]


@dataclass
class Mesh:
    inbound: Sidecar
    inbound_port: int
    callers: dict[str, int]  # service account -> its caller sidecar's outbound port
    model: str

    def client(self, caller: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.callers[caller]}/v1",
            api_key=KEY,
            max_retries=0,
            timeout=120,
            default_headers={"Host": "llm"},
        )


@pytest.fixture(scope="module")
def mesh(smollm_int4) -> Iterator[Mesh]:
    d = short_dir()
    rt = serving_runtime(smollm_int4)
    http = OpenAIServer(rt)
    inbound_port = free_port()
    doc = {
        "services": {
            "llm": {
                "versions": {"v1": {"endpoints": [f"127.0.0.1:{inbound_port}"]}},
                "callers": [{"service_account": "apps/chat", "methods": ["Generate"]}],
            }
        },
        "tenants": {"acme": {"key_sha256": hash_key(KEY), "allow": ["llm/*"]}},
        "identity": {"trust_domain": TD},
    }
    cp = build_server(parse_mesh(doc), debounce=0.02, identity_dir=str(d / "cp")).start()
    sidecars: list[Sidecar] = []
    try:
        inbound = identity_sidecar(
            cp, d, "llm-1", join_token_file(cp, "default/llm", d), service="llm", version="v1",
            inbound_port=inbound_port, local_endpoint=rt.target,
            local_http_endpoint=f"127.0.0.1:{http.port}",
        )  # fmt: skip
        ports = {"apps/chat": free_port(), "apps/mail": free_port()}
        sidecars = [inbound] + [
            identity_sidecar(
                cp, d, sa.replace("/", "-"), join_token_file(cp, sa, d), outbound_port=port
            )
            for sa, port in ports.items()
        ]
        for s in sidecars:
            s.sv.start()
        for s in sidecars:
            s.sv.wait_ready()
        m = Mesh(inbound, inbound_port, ports, rt.service.model_info.name)
        with m.client("apps/chat") as c:
            eventually(
                lambda: c.completions.create(model=m.model, prompt="Hi", max_tokens=1).choices,
                30,
                "an HTTP call through both sidecars",
            )
        yield m
    finally:
        for s in sidecars:
            s.sv.stop()
        cp.stop()
        http.stop()
        rt.shutdown(grace=0)
        shutil.rmtree(d, ignore_errors=True)


def test_a_listed_workload_chats_over_the_mtls_hop(mesh: Mesh) -> None:
    handshakes = f"listener.127.0.0.1_{mesh.inbound_port}.ssl.handshake"
    with mesh.client("apps/chat") as c:
        r = c.chat.completions.create(
            model=mesh.model, messages=QUESTION, temperature=0, max_tokens=20
        )
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert mesh.inbound.stat(handshakes) >= 1  # the hop the call took is TLS


def test_callers_rules_decide_on_openai_paths_by_method(mesh: Mesh) -> None:
    with mesh.client("apps/chat") as c, pytest.raises(openai.PermissionDeniedError) as e:
        c.models.list()  # Info: apps/chat may call Generate only
    with mesh.client("apps/mail") as c, pytest.raises(openai.PermissionDeniedError) as e2:
        c.completions.create(model=mesh.model, prompt="Hi", max_tokens=1)  # not a caller
    denied = "http.inbound_llm_v1.rbac.meshlm_callers.denied"
    assert mesh.inbound.stat(denied) >= 2
    # Envoy's own RBAC refusal in OpenAI's error shape, as the SDK reads it (issue 17).
    for err in (e.value, e2.value):
        assert err.code == "access_denied" and err.type == "permission_error", err.body
        assert err.body["message"] == "RBAC: access denied"

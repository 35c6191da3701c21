"""The tenant the runtime schedules by is the one the sidecar verified: real Envoy with the Wasm
authz filter in front of a real runtime (issue 12, item 3). A client that sends its own
`x-meshlm-tenant` to borrow another tenant's share is still scheduled as itself."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from mesh_common.headers import TENANT_HEADER
from mesh_common.ports import free_port
from model_runtime.engine.engine import Engine
from model_runtime.serving.client import Client
from model_runtime.serving.service import Runtime
from schemas import codec
from sidecar.envoy_process import EnvoyProcess
from tests import testbed
from wasm_filters import xds
from wasm_filters.policy import hash_key, parse_policy

STORY_REQUEST = codec.encode_generate_request(
    codec.GenerateRequest(
        messages=[codec.ChatMessage("user", "Write a long story about a dragon and a knight.")],
        max_new_tokens=400,
    )
)
POLICY = parse_policy(
    {
        name: {"key_sha256": hash_key(f"k-{name}"), "allow": ["llm/*"], "priority": "normal"}
        for name in ("noisy", "quiet")
    }
)


@pytest.fixture
def mesh(smollm_int4) -> Iterator[tuple[Runtime, int]]:
    engine = Engine(smollm_int4, max_batch=2, max_queue=8, tenant_max_streams=1)
    engine.start()
    rt = Runtime().start()
    rt.set_model(smollm_int4, engine)
    boot = testbed.bootstrap(
        [xds.wasm_http_filter(POLICY, service="llm")], grpc_port=rt.port, http_port=free_port()
    )
    envoy = EnvoyProcess(boot)
    try:
        envoy.start()
        envoy.wait_ready(timeout=60)
        yield rt, testbed.listener_port(boot)
    finally:
        envoy.stop()
        rt.shutdown(grace=5)


def wait_for(cond: Callable[[], bool], timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.02)


def test_a_spoofed_tenant_header_does_not_borrow_another_tenants_share(mesh) -> None:
    rt, port = mesh
    calls: list[grpc.Call] = []

    def long_call(key: str, spoof: str | None = None) -> None:
        md = [(TENANT_HEADER, spoof)] if spoof else []
        with Client(f"127.0.0.1:{port}", api_key=key, metadata=md) as c:
            call = c.generate_raw(STORY_REQUEST, timeout=120)
            calls.append(call)
            try:
                for _ in call:
                    pass
            except grpc.RpcError:
                pass  # cancelled at the end of the test

    threads = [threading.Thread(target=long_call, args=("k-noisy",))]
    threads[0].start()
    tenants = lambda: rt.engine.stats()["tenants"]  # noqa: E731
    try:
        wait_for(lambda: tenants().get("noisy", {}).get("running") == 1)
        # noisy is at its one stream; it claims to be quiet to get a second one
        threads.append(threading.Thread(target=long_call, args=("k-noisy", "quiet")))
        threads[1].start()
        wait_for(lambda: tenants().get("noisy", {}).get("queued_tokens", 0) > 0)
        assert set(tenants()) == {"noisy"}  # scheduled as noisy: waits for noisy's slot
        assert rt.engine.stats()["running"] == 1
    finally:
        for c in calls:
            c.cancel()
        for t in threads:
            t.join(60)

"""The policy delivered by the control plane (ADS + ECDS) to a real Envoy sidecar's inbound
listener: a key rotation pushed while gRPC traffic flows loses no allowed request."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import grpc

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.testbed import EchoGrpcUpstream
from wasm_filters.policy import hash_key, parse_policy
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh

GEN = "/meshlm.inference.v1.Inference/Generate"
ACME = {"allow": ["llm/*"], "priority": "high"}


def call(ch: grpc.Channel, key: str) -> tuple[grpc.StatusCode, dict]:
    try:
        reply = ch.unary_unary(GEN)(b"", metadata=[("x-api-key", key)], timeout=10)
        return grpc.StatusCode.OK, json.loads(reply)
    except grpc.RpcError as e:
        return e.code(), {}


def wait_code(ch: grpc.Channel, key: str, code: grpc.StatusCode) -> None:
    deadline = time.monotonic() + 30
    while call(ch, key)[0] != code:
        assert time.monotonic() < deadline, f"{key} never got {code}"
        time.sleep(0.05)


def test_policy_push_by_ecds_under_traffic() -> None:
    with EchoGrpcUpstream() as runtime:
        address = f"127.0.0.1:{runtime.port}"
        mesh = parse_mesh(
            {
                "services": {
                    "llm": {
                        "versions": {"v1": {"endpoints": [address]}},
                        "route": {"weights": {"v1": 100}},
                    }
                },
                "tenants": {"acme": {"key_sha256": hash_key("k-old"), **ACME}},
            }
        )
        cp = build_server(mesh, debounce=0.02).start()
        inbound = free_port()
        boot = ads_bootstrap(
            "authz-1",
            xds_address=("127.0.0.1", cp.grpc_port),
            service="llm",
            version="v1",
            inbound_port=inbound,
            local_endpoint=address,
        )
        ch = grpc.insecure_channel(
            f"127.0.0.1:{inbound}", options=[("grpc.default_authority", "llm")]
        )
        results: list[tuple[float, grpc.StatusCode]] = []
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                results.append((time.monotonic(), call(ch, "k-old")[0]))

        t = threading.Thread(target=traffic)
        try:
            with EnvoyProcess(boot) as envoy:
                wait_code(ch, "k-old", grpc.StatusCode.OK)
                _, echoed = call(ch, "k-old")
                assert echoed["x-meshlm-tenant"] == "acme" and "x-api-key" not in echoed
                assert call(ch, "k-new")[0] == grpc.StatusCode.UNAUTHENTICATED
                t.start()
                both = {"key_sha256": [hash_key("k-new"), hash_key("k-old")], **ACME}
                rotated = dataclasses.replace(mesh, tenants=parse_policy({"acme": both}))
                result = cp.update_mesh(rotated, timeout=30)
                assert result.ok and result.acked == ["authz-1"], result
                wait_code(ch, "k-new", grpc.StatusCode.OK)
                ecds = cp.syncz()["nodes"]["authz-1"]["types"]["ECDS"]
                assert ecds["acked_version"] == result.version
                time.sleep(0.3)
                removal = time.monotonic()
                only_new = {"key_sha256": hash_key("k-new"), **ACME}
                result = cp.update_mesh(
                    dataclasses.replace(mesh, tenants=parse_policy({"acme": only_new})), timeout=30
                )
                assert result.ok, result
                wait_code(ch, "k-old", grpc.StatusCode.UNAUTHENTICATED)
                stop.set()
                t.join()
                # ECDS swaps the filter config in place: the listener never drained.
                assert (
                    envoy.stats("listener_manager.listener_modified")[
                        "listener_manager.listener_modified"
                    ]
                    == 0
                )
        finally:
            stop.set()
            if t.is_alive():
                t.join()
            ch.close()
            cp.stop()
    before = [c for ts, c in results if ts < removal]
    assert len(before) >= 5 and set(before) == {grpc.StatusCode.OK}, set(before)
    assert {c for _, c in results} <= {grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED}

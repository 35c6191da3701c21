"""Helpers for the tests/test_mesh_*.py files: a control plane feeding two real Envoys, a
caller-side sidecar (outbound) and a runtime-side sidecar (inbound, Wasm authz) in front of a
real gRPC upstream that echoes the metadata it received. No tests here."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.testbed import EchoGrpcUpstream
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.server import XdsServer

GEN = "/meshlm.inference.v1.Inference/Generate"
ACME_KEY = "test-acme-key-4f1c"
# Access logs are buffered and flushed every 10 s by default (`--file-flush-interval-msec`).
FLUSH_FAST = ("--file-flush-interval-msec", "100")


@dataclass
class TwoHops:
    cp: XdsServer
    caller: EnvoyProcess  # outbound listener on `outbound_port`
    runtime_side: EnvoyProcess  # inbound listener (authz) on `inbound_port`
    outbound_port: int
    inbound_port: int
    upstream: EchoGrpcUpstream

    def call(self, metadata: list[tuple[str, str]], port: int | None = None) -> dict[str, str]:
        """One Generate call through the caller sidecar (or `port`): the echoed metadata."""
        with grpc.insecure_channel(
            f"127.0.0.1:{port or self.outbound_port}", options=[("grpc.default_authority", "llm")]
        ) as ch:
            return json.loads(ch.unary_unary(GEN)(b"", metadata=metadata, timeout=10))


@contextlib.contextmanager
def two_hops(**mesh_extra: Any) -> Iterator[TwoHops]:
    """client -> caller Envoy (outbound) -> runtime-side Envoy (inbound, Wasm authz) -> echo."""
    with EchoGrpcUpstream() as up:
        inbound = free_port()
        mesh = parse_mesh(
            {
                "services": {
                    "llm": {
                        "versions": {"v1": {"endpoints": [f"127.0.0.1:{inbound}"]}},
                        "route": {"weights": {"v1": 100}},
                    }
                },
                "tenants": {"acme": {"key_sha256": hash_key(ACME_KEY), "allow": ["llm/*"]}},
                **mesh_extra,
            }
        )
        cp = build_server(mesh, debounce=0.02).start()
        outbound = free_port()
        xds = ("127.0.0.1", cp.grpc_port)
        try:
            runtime_boot = ads_bootstrap(
                "runtime-v1",
                xds_address=xds,
                service="llm",
                version="v1",
                inbound_port=inbound,
                local_endpoint=f"127.0.0.1:{up.port}",
            )
            caller_boot = ads_bootstrap("caller-1", xds_address=xds, outbound_port=outbound)
            with (
                EnvoyProcess(runtime_boot, extra_args=FLUSH_FAST) as rs,
                EnvoyProcess(caller_boot, extra_args=FLUSH_FAST) as caller,
            ):
                yield TwoHops(cp, caller, rs, outbound, inbound, up)
        finally:
            cp.stop()


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects among the lines of a log (Envoy's own log lines are skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out

"""A real runtime (SmolLM2 int4) behind a real Envoy with the Wasm authz filter, for the client
tests (tests/test_client_*.py): tenants with a key, one allowed only Generate, one limited to
two calls an hour, one to one call an hour."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from model_runtime.serving.service import Runtime
from sidecar.envoy_process import EnvoyProcess
from tests import testbed
from tests.runtime_fixtures import serving_runtime
from wasm_filters import xds
from wasm_filters.policy import hash_key, parse_policy

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TENANTS = {
    "acme": {"key_sha256": hash_key("k-acme"), "allow": ["llm/*"]},
    "free": {"key_sha256": hash_key("k-free"), "allow": ["llm/Generate"]},
    "lim": {
        "key_sha256": hash_key("k-lim"),
        "allow": ["llm/*"],
        "rate_limit": {"max_tokens": 2, "tokens_per_fill": 1, "fill_interval": "1h"},
    },
    "mirrored": {  # one call an hour; a mirrored copy takes none (issue 18)
        "key_sha256": hash_key("k-mirrored"),
        "allow": ["llm/*"],
        "rate_limit": {"max_tokens": 1, "tokens_per_fill": 1, "fill_interval": "1h"},
    },
}


@dataclass
class Guarded:
    runtime: Runtime
    envoy_port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.envoy_port}"


def guarded_runtime(loaded) -> Iterator[Guarded]:
    """The runtime, replica id "r1", behind Envoy; stopped when the generator is closed."""
    rt = serving_runtime(loaded, replica_id="r1")
    filt = xds.wasm_http_filter(parse_policy(TENANTS), service="llm")
    boot = testbed.bootstrap([filt], grpc_port=rt.port, http_port=rt.port)
    envoy = EnvoyProcess(boot)
    try:
        envoy.start()
        envoy.wait_ready(timeout=60)
        yield Guarded(rt, testbed.listener_port(boot))
    finally:
        envoy.stop()
        rt.shutdown(grace=1)

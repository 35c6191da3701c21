"""bench/mtls_hop.py: the hop `python -m bench mesh` measures with mTLS really runs mTLS on real
Envoys (certificates of the mesh CA by SDS, handshakes counted at both ends) and the plaintext
hop it is compared with does not; keys stay out of the bootstraps."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import grpc
import pytest

from bench import mtls_hop
from bench import sidecar_parts as parts
from bench.bench_mesh import Way, _wait_ok
from mesh_common.ports import free_port
from sidecar.envoy_process import EnvoyProcess
from tests.test_identity_support import short_dir

HANDSHAKES = r"ssl\.handshake$"


@pytest.fixture(scope="module")
def upstream() -> Iterator[int]:
    port = free_port()
    with EnvoyProcess(parts.grpc_ok_upstream(port)):
        yield port


def _calls(upstream: int, ids: mtls_hop.Identities | None, *, new: bool, n: int = 3):
    """(handshakes at the caller, at the inbound Envoy) after `n` calls through one hop."""
    caller_boot, inbound_boot, port = mtls_hop.bootstraps(
        upstream, ids, new_connection_per_call=new
    )
    assert "PRIVATE KEY" not in str(caller_boot) + str(inbound_boot)
    with EnvoyProcess(inbound_boot) as inbound, EnvoyProcess(caller_boot) as caller:
        way = Way("hop", port, [caller, inbound], "llm")
        try:
            _wait_ok(way.once)
            for _ in range(n - 1):
                way.once()
        finally:
            way.channel.close()
        count = [sum(e.stats(HANDSHAKES).values()) for e in (caller, inbound)]
    return count


def test_the_mtls_hop_handshakes_and_the_plaintext_hop_does_not(upstream: int) -> None:
    with ExitStack() as stack:
        ids = mtls_hop.Identities(short_dir())
        stack.callback(ids.close)
        assert _calls(upstream, None, new=False) == [0, 0]
        assert _calls(upstream, ids, new=False) == [1, 1]  # one connection, reused
        # A new connection per call: every call shakes hands again.
        assert _calls(upstream, ids, new=True) == [3, 3]


def test_an_mtls_hop_refuses_a_plaintext_caller(upstream: int) -> None:
    ids = mtls_hop.Identities(short_dir())
    try:
        _, inbound_boot, _ = mtls_hop.bootstraps(upstream, ids, new_connection_per_call=False)
        (listener,) = inbound_boot["static_resources"]["listeners"]
        with EnvoyProcess(inbound_boot):
            way = Way("plaintext", listener["address"]["socket_address"]["port_value"], [], "llm")
            try:
                with pytest.raises(grpc.RpcError) as e:
                    way.once()
            finally:
                way.channel.close()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        ids.close()

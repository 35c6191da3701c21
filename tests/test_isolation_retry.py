"""A query of death must not walk the pool (issue 11): the caller's sidecar retries UNAVAILABLE,
so the inbound sidecar must not answer UNAVAILABLE for a call whose runtime died holding it.

Real parts: a control plane, a caller Envoy with the demo's retry policy, two inbound Envoys,
each in front of its own runtime process that exits hard on a body holding POISON.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_xds_support import eventually
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh

GEN = "/meshlm.inference.v1.Inference/Generate"
# A runtime that answers its name, and exits hard (no reply, no reset) on a query of death.
RUNTIME = """
import os, sys, threading
from concurrent import futures
import grpc
name, port = sys.argv[1], sys.argv[2]
def generate(request, context):
    if b"POISON" in request:
        os._exit(3)
    return name.encode()
handler = grpc.method_handlers_generic_handler(
    "meshlm.inference.v1.Inference", {"Generate": grpc.unary_unary_rpc_method_handler(generate)})
server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
server.add_generic_rpc_handlers((handler,))
server.add_insecure_port("127.0.0.1:" + port)
server.start()
print("ready", flush=True)
threading.Event().wait()
"""


@dataclass
class Pool:
    port: int  # the caller sidecar's outbound port
    runtimes: dict[str, subprocess.Popen]

    def call(self, body: bytes) -> tuple[grpc.StatusCode, str]:
        with grpc.insecure_channel(
            f"127.0.0.1:{self.port}", options=[("grpc.default_authority", "llm")]
        ) as ch:
            try:
                return grpc.StatusCode.OK, ch.unary_unary(GEN)(body, timeout=10).decode()
            except grpc.RpcError as e:
                return e.code(), e.details() or ""

    def alive(self) -> set[str]:
        return {n for n, p in self.runtimes.items() if p.poll() is None}


@contextlib.contextmanager
def pool_of_two() -> Iterator[Pool]:
    inbound = {n: free_port() for n in ("a", "b")}
    mesh = parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {"v1": {"endpoints": [f"127.0.0.1:{p}" for p in inbound.values()]}},
                    "route": {"weights": {"v1": 100}},
                    # The demo's (meshlm/demo/mesh.yaml).
                    "retry_policy": {
                        "retry_on": "unavailable,connect-failure,refused-stream",
                        "num_retries": 1,
                    },
                }
            }
        }
    )
    cp = build_server(mesh, debounce=0.02).start()
    xds = ("127.0.0.1", cp.grpc_port)
    runtimes: dict[str, subprocess.Popen] = {}
    try:
        with contextlib.ExitStack() as stack:
            for name, port in inbound.items():
                rt_port = free_port()
                runtimes[name] = subprocess.Popen(
                    [sys.executable, "-c", RUNTIME, name, str(rt_port)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert runtimes[name].stdout.readline().strip() == "ready"
                boot = ads_bootstrap(
                    f"runtime-{name}",
                    xds_address=xds,
                    service="llm",
                    version="v1",
                    inbound_port=port,
                    local_endpoint=f"127.0.0.1:{rt_port}",
                )
                stack.enter_context(EnvoyProcess(boot))
            caller_port = free_port()
            stack.enter_context(
                EnvoyProcess(ads_bootstrap("caller", xds_address=xds, outbound_port=caller_port))
            )
            pool = Pool(caller_port, runtimes)
            answered = lambda: {pool.call(b"hi")[1] for _ in range(8)} == {"a", "b"}  # noqa: E731
            eventually(answered, 30, "both runtimes answering through the mesh")
            yield pool
    finally:
        for p in runtimes.values():
            p.kill()
            p.wait()
        cp.stop()


def test_a_query_of_death_kills_one_replica_not_the_pool() -> None:
    with pool_of_two() as pool:
        code, message = pool.call(b"POISON")
        # A server fault the caller sees and the class windows count, not "retry elsewhere".
        assert code == grpc.StatusCode.UNKNOWN, (code, message)
        assert "reset reason: connection termination" in message
        eventually(lambda: len(pool.alive()) < 2, 10, "the poisoned runtime's exit")
        assert len(pool.alive()) == 1, "the caller's retry sent the query of death on"
        # A call that finds the dead runtime's port closed never reached it: still retried.
        (survivor,) = pool.alive()
        assert [pool.call(b"hi") for _ in range(6)] == [(grpc.StatusCode.OK, survivor)] * 6


def test_a_call_that_finds_a_replica_dead_is_retried_on_another() -> None:
    with pool_of_two() as pool:
        pool.call(b"POISON")
        eventually(lambda: len(pool.alive()) < 2, 10, "the poisoned runtime's exit")
        (survivor,) = pool.alive()
        # Concurrent calls share the load balancer's turn: without a retry host predicate a
        # retry can pick the dead replica again and the call is lost (one retry allowed).
        with ThreadPoolExecutor(max_workers=3) as ex:  # within the default retry limit (3)
            outcomes = list(ex.map(lambda _: pool.call(b"hi"), range(64)))
        assert Counter(outcomes) == {(grpc.StatusCode.OK, survivor): 64}

"""least_loaded on real Envoys: the caller's Envoy opens ORCA out-of-band streams to each replica
through its inbound sidecar (past the Wasm authz, on that one path only) and sends the busier
replica the smaller share; round_robin splits evenly. The runtimes here are grpcio servers that
report a fixed load, so the test isolates the mesh side (tests of the runtime's own reports
live beside the runtime)."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from xds.data.orca.v3 import orca_load_report_pb2
from xds.service.orca.v3 import orca_pb2

from mesh_common.ports import free_port
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from tests.test_xds_support import METHOD, eventually
from wasm_filters.policy import hash_key
from xds_server.compose import build_server
from xds_server.mesh import parse_mesh
from xds_server.resources.routes import ORCA_PATH
from xds_server.server import XdsServer

KEY = "test-acme-key-lb-7d2e"


class OrcaReplica(grpc.GenericRpcHandler):
    """A replica that answers unary calls with its name and streams a fixed ORCA load report."""

    def __init__(self, name: str, utilization: float) -> None:
        self.name, self.utilization = name, utilization
        self.orca_streams = 0
        self.served = 0
        self._stop = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self.server.add_generic_rpc_handlers((self,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method == ORCA_PATH:
            return grpc.unary_stream_rpc_method_handler(
                self._reports, request_deserializer=orca_pb2.OrcaLoadReportRequest.FromString
            )
        return grpc.unary_unary_rpc_method_handler(self._who)

    def _who(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.served += 1
        return self.name.encode()

    def _reports(self, req: orca_pb2.OrcaLoadReportRequest, context: grpc.ServicerContext):
        self.orca_streams += 1
        period = max(0.2, req.report_interval.ToTimedelta().total_seconds())
        while context.is_active() and not self._stop.is_set():
            yield orca_load_report_pb2.OrcaLoadReport(
                application_utilization=self.utilization, rps_fractional=10.0
            ).SerializeToString()
            self._stop.wait(period)

    def stop(self) -> None:
        self._stop.set()
        self.server.stop(0)


@dataclass
class Mesh2:
    cp: XdsServer
    caller: EnvoyProcess
    caller_port: int
    replicas: dict[str, OrcaReplica]
    inbound_ports: dict[str, int]

    def shares(self, n: int) -> Counter[str]:
        with grpc.insecure_channel(
            f"127.0.0.1:{self.caller_port}", options=[("grpc.default_authority", "llm")]
        ) as ch:
            call = ch.unary_unary(METHOD)
            return Counter(
                call(b"", metadata=[("x-api-key", KEY)], timeout=5).decode() for _ in range(n)
            )


@contextlib.contextmanager
def two_replicas(load_balancing: str, **route: object) -> Iterator[Mesh2]:
    """A caller Envoy -> two inbound sidecars (Wasm authz) -> a busy and an idle replica."""
    replicas = {"busy": OrcaReplica("busy", 0.9), "idle": OrcaReplica("idle", 0.1)}
    inbound = {n: free_port() for n in replicas}
    mesh = parse_mesh(
        {
            "services": {
                "llm": {
                    "versions": {"v1": {"endpoints": [f"127.0.0.1:{p}" for p in inbound.values()]}},
                    "load_balancing": load_balancing,
                    "route": {"weights": {"v1": 100}, **route},
                }
            },
            "tenants": {"acme": {"key_sha256": hash_key(KEY), "allow": ["llm/*"]}},
        }
    )
    cp = build_server(mesh, debounce=0.02).start()
    xds = ("127.0.0.1", cp.grpc_port)
    caller_port = free_port()
    try:
        with contextlib.ExitStack() as stack:
            for name, r in replicas.items():
                boot = ads_bootstrap(
                    f"runtime-{name}",
                    xds_address=xds,
                    service="llm",
                    version="v1",
                    inbound_port=inbound[name],
                    local_endpoint=f"127.0.0.1:{r.port}",
                )
                stack.enter_context(EnvoyProcess(boot))
            caller = stack.enter_context(
                EnvoyProcess(ads_bootstrap("caller", xds_address=xds, outbound_port=caller_port))
            )
            yield Mesh2(cp, caller, caller_port, replicas, inbound)
    finally:
        cp.stop()
        for r in replicas.values():
            r.stop()


def test_least_loaded_sends_the_busy_replica_the_smaller_share() -> None:
    with two_replicas("least_loaded") as m:
        eventually(lambda: sum(m.shares(4).values()) == 4, 30, "calls through the mesh")
        # Each host reports out of band through its inbound sidecar, without an API key.
        eventually(
            lambda: all(r.orca_streams for r in m.replicas.values()), 15, "ORCA streams opened"
        )
        oob = "cluster.outbound|llm|v1.lb_orca_oob."
        eventually(lambda: m.caller.stats()[oob + "reports_received"] >= 4, 15, "reports received")
        stats = m.caller.stats()
        assert stats[oob + "active_sessions"] == 2
        assert stats[oob + "report_errors"] == stats[oob + "stream_failures"] == 0
        # Past the blackout period, weights follow the reports: 0.9 vs 0.1 utilization at the
        # same rps is a 1:9 split.
        eventually(lambda: m.shares(40)["busy"] <= 10, 30, "the busy replica's share falls")
        share = m.shares(100)
        assert share["busy"] < share["idle"] / 2, share


def test_round_robin_splits_evenly_and_opens_no_orca_stream() -> None:
    with two_replicas("round_robin") as m:
        eventually(lambda: sum(m.shares(4).values()) == 4, 30, "calls through the mesh")
        share = m.shares(100)
        assert 35 <= share["busy"] <= 65, share
        assert not any(r.orca_streams for r in m.replicas.values())


def test_the_authz_bypass_is_the_orca_method_alone() -> None:
    with two_replicas("least_loaded") as m:
        port = m.inbound_ports["idle"]
        eventually(lambda: m.replicas["idle"].orca_streams, 30, "ORCA stream opened")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            for path in (METHOD, ORCA_PATH + "x", "/xds.service.orca.v3.OpenRcaService/"):
                with pytest.raises(grpc.RpcError) as e:
                    ch.unary_unary(path)(b"", timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (path, e.value)
            # ...while the ORCA method itself needs no key.
            stream = ch.unary_stream(ORCA_PATH)(
                orca_pb2.OrcaLoadReportRequest().SerializeToString(), timeout=5
            )
            first = orca_load_report_pb2.OrcaLoadReport.FromString(next(stream))
            stream.cancel()
            assert first.application_utilization == pytest.approx(0.1)


def test_with_a_hash_policy_the_hash_picks_the_version_and_load_picks_the_replica() -> None:
    """Sticky sessions and least_loaded together: the route still hashes the tenant header to
    pick a version (use_hash_policy), and CSWRR, which ignores the hash, picks the replica."""
    sticky = {"hash_policy": {"header": "x-meshlm-tenant"}, "use_hash_policy": True}
    with two_replicas("least_loaded", **sticky) as m:
        eventually(lambda: sum(m.shares(4).values()) == 4, 30, "calls through the mesh")
        route = m.caller.config_dump("dynamic_route_configs")["configs"][0]
        action = route["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]
        assert action["hash_policy"] == [{"header": {"header_name": "x-meshlm-tenant"}}]
        assert action["weighted_clusters"]["use_hash_policy"] is True
        eventually(lambda: m.shares(40)["busy"] <= 10, 30, "the busy replica's share falls")

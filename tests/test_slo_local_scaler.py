"""The local scaler on real processes: `scale_out` starts `meshlm serve` (the real model) and its
inbound `meshlm sidecar`; added by EDS, the replica answers Generate calls through a caller
Envoy; `scale_in` stops both processes."""

from __future__ import annotations

import json
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from model_runtime.client import Client
from sidecar.bootstrap import ads_bootstrap
from sidecar.envoy_process import EnvoyProcess
from sidecar.ports import free_port
from tests.test_xds_support import eventually
from xds_server.control_plane import ControlPlane
from xds_server.mesh import parse_mesh
from xds_server.scaler import LocalScaler


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        req = health_pb2.HealthCheckRequest()
        return health_pb2_grpc.HealthStub(ch).Check(req, timeout=5).status


def _generate(port: int) -> str:
    with Client(f"127.0.0.1:{port}", authority="llm") as c:
        chunks = list(
            c.generate(messages=[{"role": "user", "content": "Say hi."}], max_new_tokens=2,
                       timeout=30)
        )  # fmt: skip
    return "".join(ch.text_delta for ch in chunks)


def test_local_scaler_replica_serves_through_the_mesh_and_is_stopped(tmp_path) -> None:
    mesh = parse_mesh(
        {"services": {"llm": {"versions": {"v1": {"precision": "int4", "endpoints": []}}}}}
    )
    with ControlPlane(mesh, debounce=0.02) as cp:
        scaler = LocalScaler(
            f"127.0.0.1:{cp.grpc_port}", serve_args=["--precision", "int4"], workdir=str(tmp_path)
        )
        endpoint = scaler.scale_out("llm", "v1")
        procs = list(scaler.procs[endpoint])
        try:
            # Added by EDS as soon as scale_out returns: the model must be loaded by then.
            runtime_port = int(procs[1].args[procs[1].args.index("--port") + 1])
            assert _health(runtime_port) == health_pb2.HealthCheckResponse.SERVING
            assert cp.add_endpoint("llm", "v1", endpoint).ok
            port = free_port()
            boot = ads_bootstrap("caller", xds_address=("127.0.0.1", cp.grpc_port),
                                 outbound_port=port)  # fmt: skip
            with EnvoyProcess(boot):
                assert eventually(lambda: _generate(port), 60, "a Generate call answered")
            # The SLO loop reads the new runtime's TTFT there (issue 12 follow-up, gap b).
            with urllib.request.urlopen(scaler.metrics_url(endpoint), timeout=5) as r:
                assert json.loads(r.read())["ttft_ms"]["count"] >= 1
        finally:
            scaler.scale_in("llm", "v1", endpoint)
        assert all(p.poll() is not None for p in procs)
        assert endpoint not in scaler.procs and scaler.metrics_url(endpoint) is None
